"""NVRx's ``test_async_writer.py`` / ``test_async_writer_msc.py`` behaviours on 2 gloo ranks.

One launch runs every scenario in order (a launch costs a spawn and a torch import per rank
and a worker per queue, so scenarios share them); the abort scenarios come last because
``abort_nvrx_checkpoint`` stops every queue of the process. Each scenario function names
the upstream test(s) it covers (docs/compat.md). A failed assertion on any rank comes back
as a ``RankFailure`` with that rank's traceback.
"""

from __future__ import annotations

import copy
import filecmp
import importlib.util
import os
import pickle
import time
from dataclasses import fields
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import (
    CheckpointException,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.checkpoint.utils import _DistWrapper
from torch.distributed.device_mesh import init_device_mesh

from resilient_ckpt._torch_compat import DTensor, Shard
from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest, abort_nvrx_checkpoint
from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from resilient_ckpt.async_ckpt.state_dict_saver import (
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from resilient_ckpt.async_ckpt.torch_ckpt import TorchAsyncCheckpoint
from resilient_ckpt.testing.launcher import launch
from resilient_ckpt.utils import diff
from tests._helpers import torch_serial_layout

from ._async_common import failing_open

pytestmark = [pytest.mark.dist, pytest.mark.timeout(480)]


def _state(rank: int, world: int, fill: float | None = None) -> dict[str, Any]:
    """A sharded tensor (every rank writes), replicated tensors (rank 0 writes), a scalar."""
    torch.manual_seed(1)
    mesh = init_device_mesh("cpu", (world,))
    full = torch.rand(8 * world, 16)
    local = full[rank * 8 : (rank + 1) * 8].clone()
    state: dict[str, Any] = {
        "sharded": DTensor.from_local(local, mesh, [Shard(0)], run_check=False),
        **{f"param_{i}": torch.rand(32, 32) for i in range(3)},
        "step": 7,
    }
    if fill is not None:
        state["sharded"].to_local().fill_(fill)
        for i in range(3):
            state[f"param_{i}"].fill_(fill)
    return state


def _schedule(queue: AsyncCallsQueue, path: str, state: dict, **writer_kwargs: Any) -> None:
    """NVRx's recipe: plan, wrap the writer's save function, finalize in a finalize fn."""
    caching = writer_kwargs.pop("caching", False)
    writer = FileSystemWriterAsync(path, thread_count=1, **writer_kwargs)
    plan_result = save_state_dict_async_plan(
        state, writer, None, 0, planner=DefaultSavePlanner(), enable_cache=caching
    )
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    queue.schedule_async_request(
        AsyncRequest(
            save_fn,
            args,
            [lambda: save_state_dict_async_finalize(*plan_result)],
            preload_fn=preload_fn,
            async_fn_kwargs={},
        )
    )


def _load(path: str, like: dict) -> dict:
    state = copy.deepcopy(like)
    for value in state.values():
        if isinstance(value, torch.Tensor):
            (value.to_local() if isinstance(value, DTensor) else value).zero_()
    dcp.load(state, storage_reader=FileSystemReader(path))
    return state


def _values(state: dict) -> dict:
    return {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in state.items()}


def _assert_equal_states(a: dict, b: dict) -> None:
    assert not any(len(x) for x in diff(_values(a), _values(b))), diff(_values(a), _values(b))


def _fresh(root: str, name: str) -> str:
    path = os.path.join(root, name)
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    return path


def _async_equals_sync(rank: int, world: int, root: str, queues: dict) -> None:
    """test_async_writer.py::TestAsyncSave::test_async_is_equivalent_to_sync[*] and
    test_async_writer_msc.py::TestAsyncSaveWithMSC::test_async_is_equivalent_to_sync"""
    state = _state(rank, world)
    sync_dir = _fresh(root, "sync")
    with torch_serial_layout():
        dcp.save(state, storage_writer=FileSystemWriter(sync_dir), planner=DefaultSavePlanner())
    cases = [("daemon", False, False), ("plain", True, False), ("plain", False, False)]
    if importlib.util.find_spec("multistorageclient") is not None:  # the msc extra
        cases.append(("daemon", False, True))  # use_msc=True with a plain path
    for k, (queue_name, multiproc, use_msc) in enumerate(cases):
        path = _fresh(root, f"async_{k}")
        _schedule(queues[queue_name], path, state, is_multiproc_io=multiproc, use_msc=use_msc)
        queues[queue_name].maybe_finalize_async_calls(blocking=True, no_dist=False)
        dist.barrier()
        if rank == 0:
            cmp = filecmp.dircmp(path, sync_dir)
            assert not cmp.left_only and not cmp.right_only, (cmp.left_only, cmp.right_only)
            assert cmp.diff_files in ([], [".metadata"]), cmp.diff_files
        loaded_async, loaded_sync = _load(path, state), _load(sync_dir, state)
        _assert_equal_states(loaded_async, loaded_sync)
        _assert_equal_states(loaded_sync, state)


def _expect_failure(queue: AsyncCallsQueue, path: str) -> str:
    with pytest.raises(CheckpointException) as info:
        queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    dist.barrier()
    assert not os.path.exists(os.path.join(path, ".metadata"))  # nothing committed
    return str(info.value)


def _invalid_setup_and_errors(rank: int, world: int, root: str, queues: dict) -> None:
    """test_async_writer.py::TestAsyncSave::test_invalid_async_setup[True-True] and
    ::test_errors_are_reported[True] / [False]"""
    state = _state(rank, world)
    path = _fresh(root, "invalid_setup")
    _schedule(queues["daemon"], path, state, is_multiproc_io=True)
    message = _expect_failure(queues["daemon"], path)
    assert "Invalid Setup!" in message and "is_daemon=False" in message  # on every rank
    for queue_name, multiproc in (("plain", True), ("daemon", False)):
        path = _fresh(root, f"errors_{multiproc}")
        opener = failing_open if rank == world - 1 else open
        _schedule(queues[queue_name], path, state, is_multiproc_io=multiproc, open_file=opener)
        message = _expect_failure(queues[queue_name], path)
        assert "Worker failure" in message and f"rank {world - 1}" in message
        assert "worker critical failure during open()" in message
    # The queues still work after failed saves.
    path = _fresh(root, "after_errors")
    _schedule(queues["daemon"], path, state)
    queues["daemon"].maybe_finalize_async_calls(blocking=True, no_dist=False)
    _assert_equal_states(_load(path, state), state)


def _metadata(path: str) -> Any:
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return pickle.load(f)


def _cached_metadata(rank: int, world: int, root: str, queues: dict) -> None:
    """test_async_writer.py::TestAsyncSave::test_cached_metadata"""
    state = _state(rank, world)
    first = _fresh(root, "uncached")
    _schedule(queues["daemon"], first, state, caching=True)
    queues["daemon"].maybe_finalize_async_calls(blocking=True, no_dist=False)
    for i in range(3):  # the 2nd and 3rd saves reuse the cached plan
        last = _fresh(root, f"cached_{i}")
        _schedule(queues["daemon"], last, copy.deepcopy(state), caching=True)
        queues["daemon"].maybe_finalize_async_calls(blocking=True, no_dist=False)
    _assert_equal_states(_load(first, state), _load(last, state))
    if rank == 0:
        md_first, md_last = _metadata(first), _metadata(last)
        for field in fields(md_first):
            if field.name not in ("storage_data", "storage_meta"):
                a, b = getattr(md_first, field.name), getattr(md_last, field.name)
                assert not any(len(x) for x in diff(a, b)), field.name


def _staging_switches(rank: int, world: int, root: str, queues: dict) -> None:
    """test_async_writer.py::TestAsyncSave::test_cached_data_structure,
    ::test_cached_data_structure_refreshes_when_tensor_data_ptr_changes and
    ::test_cpu_shm_for_gpu_tensors (on CPU tensors: each save holds the values of its time,
    whether the tensors are changed in place or reallocated)."""
    FileSystemWriterAsync.cleanup_tensor_caches()
    kept = _state(rank, world)
    for reallocate in (False, True):
        ptrs, alive = set(), []
        for i in range(3):
            if reallocate:
                # Earlier states stay alive so the allocator cannot hand a freed address back.
                state = _state(rank, world, fill=float(i))
                alive.append(state)
            else:
                state = kept  # the same tensors, changed in place
                state["sharded"].to_local().fill_(float(i))
                for j in range(3):
                    state[f"param_{j}"].fill_(float(i))
            ptrs.add(state["param_0"].data_ptr())
            path = _fresh(root, f"switches_{reallocate}_{i}")
            _schedule(
                queues["daemon"],
                path,
                state,
                use_cached_data_structure=True,
                use_cpu_shm_for_gpu_tensors=True,
            )
            queues["daemon"].maybe_finalize_async_calls(blocking=True, no_dist=False)
        assert len(ptrs) == (3 if reallocate else 1)
        loaded = _load(path, state)
        assert torch.all(loaded["sharded"].to_local() == 2.0)
        assert all(torch.all(loaded[f"param_{j}"] == 2.0) for j in range(3))


def _stub_result(fqn: str, path: str, offset: int, length: int) -> WriteResult:
    return WriteResult(
        index=MetadataIndex(fqn=fqn),
        size_in_bytes=length,
        storage_data=_StorageInfo(relative_path=path, offset=offset, length=length),
    )


def _reuse_finalize(path: str, prepared: Metadata, results: list[WriteResult]) -> None:
    writer = FileSystemWriterAsync(path)
    writer.retrieve_write_results = lambda: results  # type: ignore[method-assign]
    wrapper = _DistWrapper(group=None, use_dist=True, coordinator_rank=0)
    save_state_dict_async_finalize(writer, None, wrapper, reuse_metadata_obj=prepared)


def _metadata_reuse(rank: int, world: int, root: str, queues: dict) -> None:
    """test_metadata_reuse_validation.py::TestReuseFinalizeLayoutGuard::* (layouts stubbed
    as upstream does), then the real flow: create the metadata on one save, reuse it on the
    next, and a grown non-tensor item fails the save on every rank, nothing committed."""
    sizes = {"opt": 1645, "w": 4096}
    entries = []
    for r in range(world):
        entries.append((f"opt.rank_{r}", f"__{r}_0.distcp", 0, sizes["opt"]))
        entries.append((f"w.rank_{r}", f"__{r}_0.distcp", sizes["opt"], sizes["w"]))
    prepared = Metadata(
        state_dict_metadata={},
        storage_data={
            MetadataIndex(fqn=f): _StorageInfo(relative_path=p, offset=o, length=n)
            for f, p, o, n in entries
        },
    )
    mine = [_stub_result(*e) for e in entries if e[0].endswith(f"rank_{rank}")]
    path = _fresh(root, "reuse_match")
    _reuse_finalize(path, prepared, mine)
    dist.barrier()
    assert _metadata(path).storage_data == prepared.storage_data
    path = _fresh(root, "reuse_stale")
    if rank == 0:  # the optimizer item grew by 64 bytes, the weight after it moved
        mine = [
            _stub_result("opt.rank_0", "__0_0.distcp", 0, 1709),
            _stub_result("w.rank_0", "__0_0.distcp", 1709, 4096),
        ]
    with pytest.raises(CheckpointException, match="stale"):
        _reuse_finalize(path, prepared, mine)
    dist.barrier()
    assert not os.path.exists(os.path.join(path, ".metadata"))

    state = _state(rank, world)
    state["extra"] = {"step": 255, "note": "x"}  # a pickled (non-tensor) item
    created_path = os.path.join(root, "prepared.metadata")
    plan = save_state_dict_async_plan(state, FileSystemWriterAsync(_fresh(root, "create")))
    save_fn, preload_fn, args = plan[0].get_save_function_and_args()
    AsyncRequest(save_fn, args, [], preload_fn=preload_fn).execute_sync()
    created = save_state_dict_async_finalize(*plan, create_metadata_path=created_path)
    dist.barrier()
    assert (
        created is not None
        and created.storage_data == _metadata(plan[0].checkpoint_dir).storage_data
    )
    with open(created_path, "rb") as f:
        assert pickle.load(f).storage_data == created.storage_data
    # Same pickled size (the zip format pads to 64 bytes) vs. a note grown by 300 bytes.
    for step, note, should_fail in ((200, "y", False), (201, "z" * 300, True)):
        state["extra"] = {"step": step, "note": note}
        path = _fresh(root, f"reuse_real_{step}")
        plan = save_state_dict_async_plan(state, FileSystemWriterAsync(path))
        save_fn, preload_fn, args = plan[0].get_save_function_and_args()
        AsyncRequest(save_fn, args, [], preload_fn=preload_fn).execute_sync()
        if should_fail:
            with pytest.raises(CheckpointException, match="stale for item"):
                save_state_dict_async_finalize(*plan, reuse_metadata_obj=created)
            dist.barrier()
            assert not os.path.exists(os.path.join(path, ".metadata"))
        else:
            save_state_dict_async_finalize(*plan, reuse_metadata_obj=created)
            loaded = _load(path, state)
            assert loaded["extra"] == {"step": 200, "note": "y"}
            _assert_equal_states(loaded, state)


def _running(caller: Any) -> bool:
    return caller is not None and caller._debug_is_async_process_running()


def _multiple_queues_and_abort(rank: int, world: int, root: str, queues: dict) -> None:
    """test_async_writer.py::TestAsyncSave::test_async_cp_with_multiple_queue_and_abort[*]
    (the non-daemon queue with multi-process I/O here; tests/compat/test_compat_async_worker.py
    aborts and restarts the default daemon worker)."""
    state = _state(rank, world)
    torch_ckpt = TorchAsyncCheckpoint(persistent_queue=True)
    plain_state = {k: v for k, v in state.items() if k != "sharded"}
    dist_queue = queues["plain"]
    for round_ in range(2):
        _schedule(dist_queue, _fresh(root, "multi_dist"), state, is_multiproc_io=True)
        no_dist_dir = _fresh(root, "multi_no_dist")
        if rank == 0:
            torch_ckpt.async_save(plain_state, os.path.join(no_dist_dir, "test.pt"))
        dist_queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
        torch_ckpt.finalize_async_save(blocking=True, no_dist=True)
        assert _running(dist_queue._get_async_caller())
        assert _running(torch_ckpt._get_async_calls_queue()._get_async_caller()) == (rank == 0)
        if round_ == 0:
            abort_nvrx_checkpoint()
            for queue in (queues["daemon"], dist_queue, torch_ckpt._get_async_calls_queue()):
                assert not _running(queue._get_async_caller())
            dist.barrier()
    if rank == 0:
        loaded = torch.load(os.path.join(no_dist_dir, "test.pt"))
        _assert_equal_states(loaded, plain_state)
    torch_ckpt.close()


def _abort_then_delete(rank: int, world: int, root: str, queues: dict) -> None:
    """test_async_writer.py::TestAsyncSave::test_async_cp_with_multiple_queue_and_abort_followed_by_delete"""
    queue = queues["daemon"]  # persistent; its worker was stopped by the abort above
    with pytest.raises(RuntimeError, match="fake training failure"):
        try:
            _schedule(queue, _fresh(root, "abort_delete"), _state(rank, world))
            raise RuntimeError("fake training failure")
        finally:
            abort_nvrx_checkpoint()
    caller = queue.persistent_caller
    queue.__del__()  # training exits: no collective, no hang, no error
    assert not _running(caller)


def _all_scenarios(rank: int, world: int, root: str) -> None:
    queues = {"daemon": AsyncCallsQueue(is_daemon=True), "plain": AsyncCallsQueue(is_daemon=False)}
    for queue in queues.values():  # boot both workers at once, not one per first save
        queue._get_async_caller()._start_worker(rank)
    scenarios = (
        _async_equals_sync,
        _invalid_setup_and_errors,
        _cached_metadata,
        _staging_switches,
        _metadata_reuse,
        _multiple_queues_and_abort,
        _abort_then_delete,
    )
    try:
        for scenario in scenarios:
            started = time.perf_counter()
            scenario(rank, world, root, queues)
            if rank == 0:
                print(f"{scenario.__name__}: {time.perf_counter() - started:.1f}s", flush=True)
    finally:
        for queue in queues.values():
            queue.close(abort=True)


def test_nvrx_async_writer_behaviours_on_two_ranks(tmp_path) -> None:
    launch(_all_scenarios, 2, str(tmp_path), timeout=420)
