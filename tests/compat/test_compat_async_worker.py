"""NVRx behaviours of ``TorchAsyncCheckpoint`` and the persistent worker, on one rank.

Upstream runs these with a process group; ``TorchAsyncCheckpoint`` finalizes with
``no_dist=True`` and the queue below with ``no_dist=True``, so one process shows the same
behaviour. Each test names the upstream test(s) it covers (docs/compat.md).
"""

from __future__ import annotations

import functools
import gc
import os
import weakref

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.utils import _DistWrapper

from resilient_ckpt._torch_compat import no_dist_kwargs
from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest, abort_nvrx_checkpoint
from resilient_ckpt.async_ckpt.torch_ckpt import TorchAsyncCheckpoint
from resilient_ckpt.errors import AsyncCallFailedError

from ._async_common import (
    GatedOpen,
    failing_preload,
    failing_write,
    prepared_writer,
    wait_for_file,
    write_marker,
)

pytestmark = pytest.mark.timeout(240)


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {f"param_{i}": torch.rand(64, 64) for i in range(4)}


def _assert_same(path_a, path_b, state) -> None:
    a, b = torch.load(path_a), torch.load(path_b)
    assert a.keys() == b.keys() == state.keys()
    for key in state:
        assert torch.equal(a[key], b[key]) and torch.equal(a[key], state[key])


def _worker_running(ckpt: TorchAsyncCheckpoint) -> bool:
    queue = ckpt._get_async_calls_queue()
    assert queue is not None
    caller = queue._get_async_caller()
    return caller is not None and caller._debug_is_async_process_running()


def test_async_save_equals_sync_save(tmp_path) -> None:
    """test_async_save.py::TestAsyncSave::test_async_is_equivalent_to_sync"""
    state = _state()
    ckpt = TorchAsyncCheckpoint()
    try:
        ckpt.async_save(state, tmp_path / "async.pt")
        ckpt.save(state, tmp_path / "sync.pt")
        ckpt.finalize_async_save(blocking=True)
        _assert_same(tmp_path / "async.pt", tmp_path / "sync.pt", state)
    finally:
        ckpt.close()


@pytest.mark.parametrize("finalize_first", [True, False], ids=["finalized", "during_save"])
def test_abort_stops_the_worker_and_the_next_save_restarts_it(tmp_path, finalize_first) -> None:
    """test_async_save.py::TestAsyncSave::test_persistent_async_cp_abort and
    ::test_persistent_async_cp_abort_during_cp_ops"""
    state = _state()
    ckpt = TorchAsyncCheckpoint(persistent_queue=True)
    try:
        ckpt.save(state, tmp_path / "sync.pt")
        ckpt.async_save(state, tmp_path / "async.pt")
        if finalize_first:
            ckpt.finalize_async_save(blocking=True)
        assert _worker_running(ckpt)
        abort_nvrx_checkpoint()
        assert not _worker_running(ckpt)
        assert ckpt._get_async_calls_queue().get_num_unfinalized_calls() == 0
        ckpt.async_save(state, tmp_path / "async.pt")
        ckpt.finalize_async_save(blocking=True)
        assert _worker_running(ckpt)
        _assert_same(tmp_path / "async.pt", tmp_path / "sync.pt", state)
    finally:
        ckpt.close()


def _finish(writer, metadata) -> None:
    _DistWrapper(None, False, 0).all_reduce(
        "write", writer.retrieve_write_results, functools.partial(writer.finish, metadata)
    )


@pytest.mark.parametrize("is_daemon", [True, False])
def test_worker_writes_after_the_trainer_released_its_tensors(tmp_path, is_daemon) -> None:
    """test_staging_source_lifetime.py::test_real_cpu_worker_writes_after_trainer_releases_staging
    (and test_preload_snapshot.py's point: a shared-memory tensor changed after scheduling
    does not reach the checkpoint)."""
    started, release = tmp_path / "write_started", tmp_path / "allow_write"
    ckpt_dir = tmp_path / "ckpt"
    queue = AsyncCallsQueue(is_daemon=is_daemon, cpu_shm_mode=True, cpu_priority=None)
    value = torch.arange(8).share_memory_()
    finalized = False
    try:
        writer, _, metadata = prepared_writer(
            ckpt_dir, {"value": value, "step": 3}, open_file=GatedOpen(started, release)
        )
        snapshot_ref = weakref.ref(writer.write_buckets[0][2][1][0][1])
        save_fn, preload_fn, args = writer.get_save_function_and_args()
        request = AsyncRequest(
            save_fn, args, [functools.partial(_finish, writer, metadata)], preload_fn=preload_fn
        )
        assert queue.schedule_async_request(request) == 0
        del request, save_fn, preload_fn, args
        wait_for_file(started)
        gc.collect()
        assert snapshot_ref() is None  # the write is blocked, the trainer holds nothing
        value.fill_(-1)  # training goes on, in place
        assert queue.get_num_unfinalized_calls() == 1
        assert queue.maybe_finalize_async_calls(no_dist=True) == []
        release.touch()
        assert queue.maybe_finalize_async_calls(blocking=True, no_dist=True) == [0]
        finalized = True
        restored = {"value": torch.empty(8, dtype=torch.int64), "step": 0}
        dcp.load(
            restored, storage_reader=FileSystemReader(str(ckpt_dir)), **no_dist_kwargs(dcp.load)
        )
        assert torch.equal(restored["value"], torch.arange(8)) and restored["step"] == 3
    finally:
        release.touch()
        queue.close(abort=not finalized)


def test_worker_reports_preload_and_write_failures_and_runs_plain_requests(tmp_path) -> None:
    """test_staging_source_lifetime.py::test_preload_failure_does_not_signal_success,
    ::test_write_failure_does_not_signal_completion and
    ::test_worker_without_preload_preserves_execution_arguments, on the real worker."""
    marker = str(tmp_path / "written")
    queue = AsyncCallsQueue()
    try:
        queue.schedule_async_request(
            AsyncRequest(write_marker, (marker, None), [], preload_fn=failing_preload)
        )
        with pytest.raises(AsyncCallFailedError, match="preload failed"):
            queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
        assert not os.path.exists(marker)  # the write never ran
        finalized: list[int] = []
        queue.schedule_async_request(AsyncRequest(failing_write, (), [lambda: finalized.append(1)]))
        with pytest.raises(AsyncCallFailedError, match="write failed"):
            queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
        assert finalized == []  # a failed call is never finalized
        idx = queue.schedule_async_request(
            AsyncRequest(write_marker, (marker, 42), [], {"label": "snapshot"})
        )
        assert queue.maybe_finalize_async_calls(blocking=True, no_dist=True) == [idx]
        with open(marker) as f:
            assert f.read() == "(42,) snapshot"
    finally:
        queue.close(abort=True)
