"""Multi-process (gloo, CPU) checks of the async DCP writer, planner cache and commit.

Each ``launch`` costs several seconds (spawn + torch import per rank, plus a worker per
rank for persistent queues), so each test packs several checks into one launch; the rank
functions assert, and a failed assertion comes back as a ``RankFailure`` with its traceback.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import (
    CheckpointException,
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
)
from torch.distributed.device_mesh import init_device_mesh

from resilient_ckpt._torch_compat import DTensor, Shard
from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from resilient_ckpt.async_ckpt.state_dict_saver import (
    CheckpointMetadataCache,
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from resilient_ckpt.async_ckpt.verify import verify_checkpoint
from resilient_ckpt.testing.launcher import launch
from tests._helpers import torch_serial_layout

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

_ROWS = 32


def _full() -> torch.Tensor:
    return torch.arange(_ROWS * 3, dtype=torch.float32).reshape(_ROWS, 3)


def _sharded_state(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    rows = _ROWS // world
    local = _full()[rank * rows : (rank + 1) * rows].clone()
    return {
        "dt": DTensor.from_local(local, mesh, [Shard(0)], run_check=False),
        "rep": torch.arange(100, dtype=torch.float64),
        "layer.weight": torch.ones(16, 8),
        "step": 3,
    }


def _empty_like(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, DTensor):
            out[key] = DTensor.from_local(
                torch.zeros_like(value.to_local()), value.device_mesh, value.placements
            )
        elif torch.is_tensor(value):
            out[key] = torch.zeros_like(value)
        else:
            out[key] = None
    return out


def _assert_equal(expected: dict[str, Any], actual: dict[str, Any]) -> None:
    for key, value in expected.items():
        if isinstance(value, DTensor):
            assert torch.equal(value.to_local(), actual[key].to_local()), key
        elif torch.is_tensor(value):
            assert torch.equal(value, actual[key]), key
        else:
            assert value == actual[key], key


def _plan_and_request(state, writer, **plan_kwargs) -> AsyncRequest:
    plan_ret = save_state_dict_async_plan(state, writer, **plan_kwargs)
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    finalize = functools.partial(save_state_dict_async_finalize, *plan_ret)
    return AsyncRequest(save_fn, args, [finalize], preload_fn=preload_fn)


class FailingWriter(FileSystemWriterAsync):
    """Fails every data file write of rank 1 (runs inside the background process)."""

    @classmethod
    def write_preloaded_data(cls, job, write_bucket):
        if job.rank == 1:
            raise OSError(f"injected write failure on rank {job.rank}")
        return super().write_preloaded_data(job, write_bucket)


def _check_commit_fails_everywhere(queue: AsyncCallsQueue, state, path: str) -> None:
    queue.schedule_async_request(_plan_and_request(state, FailingWriter(path, thread_count=2)))
    with pytest.raises(CheckpointException) as info:
        queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    assert set(info.value.failures) == {1}
    assert "injected write failure on rank 1" in str(info.value)
    dist.barrier()
    names = os.listdir(path)
    assert ".metadata" not in names, names
    # The failure travelled back as a report: only data files are left, nothing else.
    assert all(name.endswith(".distcp") for name in names), names


def _check_cache(rank: int, world: int, state, root: str) -> None:
    """Five saves through the plan cache, a tensor added at the fourth: each loads back
    exactly on every rank. (That the steady ones plan nothing is the performance contract,
    ``tests/unit/test_performance_contract.py``.)"""
    cache = CheckpointMetadataCache()
    for i in range(5):
        if i == 3:
            state = dict(state, added=torch.full((5,), float(world)))
        path = os.path.join(root, f"cached{i}")
        request = _plan_and_request(
            state,
            FileSystemWriterAsync(path, thread_count=2),
            enable_cache=True,
            metadata_cache=cache,
        )
        request.execute_sync()
        loaded = _empty_like(state)
        dcp.load(loaded, checkpoint_id=path)
        _assert_equal(state, loaded)


# -- 4 ranks --------------------------------------------------------------------------------


def _four_rank_checks(rank: int, world: int, root: str) -> dict[str, Any]:
    state = _sharded_state(rank, world)
    ref, ours = os.path.join(root, "torch_writer"), os.path.join(root, "sharded4")
    with warnings.catch_warnings(), torch_serial_layout():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(ref))
    _plan_and_request(state, FileSystemWriterAsync(ours, thread_count=1)).execute_sync()
    dist.barrier()
    with open(os.path.join(ref, f"__{rank}_0.distcp"), "rb") as a:
        with open(os.path.join(ours, f"__{rank}_0.distcp"), "rb") as b:
            assert a.read() == b.read(), f"rank {rank}: data file differs from torch's"
    loaded = _empty_like(state)
    dcp.load(loaded, checkpoint_id=ours)
    _assert_equal(state, loaded)
    files = verify_checkpoint(ours).files if rank == 0 else {}

    fork_queue = AsyncCallsQueue(persistent=False)
    _check_commit_fails_everywhere(fork_queue, state, os.path.join(root, "failed4"))
    fork_queue.close()
    _check_cache(rank, world, state, root)
    return {"files": sorted(files)}


@pytest.fixture(scope="module")
def four_rank_run(tmp_path_factory) -> tuple[str, list[dict[str, Any]]]:
    root = str(tmp_path_factory.mktemp("four_ranks"))
    return root, launch(_four_rank_checks, 4, root, timeout=200)


def test_four_ranks_format_commit_and_cache(four_rank_run) -> None:
    _, results = four_rank_run
    assert results[0]["files"] == [f"__{r}_0.distcp" for r in range(4)]


# -- 2 ranks: the reference's example flow, verbatim modulo import prefix and path ----------


def async_save_checkpoint(checkpoint_path, state_dict, thread_count=2, persistent=True):
    """Save checkpoint asynchronously (the usage guide's MSC example, local path)."""
    async_queue = AsyncCallsQueue(persistent=persistent)
    writer = FileSystemWriterAsync(checkpoint_path, thread_count=thread_count)
    coordinator_rank = 0
    planner = DefaultSavePlanner()
    save_state_dict_ret = save_state_dict_async_plan(
        state_dict, writer, None, coordinator_rank, planner=planner
    )
    save_fn, preload_fn, save_args = writer.get_save_function_and_args()

    def finalize_fn():
        """Finalizes async checkpointing and synchronizes processes."""
        save_state_dict_async_finalize(*save_state_dict_ret)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    async_request = AsyncRequest(save_fn, save_args, [finalize_fn], preload_fn=preload_fn)
    async_queue.schedule_async_request(async_request)
    return async_queue


def load_checkpoint(checkpoint_path, state_dict):
    reader = FileSystemReader(checkpoint_path)
    dcp.load(state_dict=state_dict, storage_reader=reader, planner=DefaultLoadPlanner())
    return state_dict


def _model_state(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    state: dict[str, Any] = dict(torch.nn.Linear(16, 8).state_dict())
    state.update(_sharded_state(rank, world))
    return state


def _example_flow(rank: int, world: int, path: str, persistent: bool) -> AsyncCallsQueue:
    state = _model_state(rank, world)
    snapshot = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
    queue = async_save_checkpoint(path, state, persistent=persistent)
    for value in state.values():  # training goes on right after scheduling
        if torch.is_tensor(value):
            value.data.add_(1000)
    queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    loaded = load_checkpoint(path, _empty_like(state))
    _assert_equal(snapshot, loaded)
    return queue


def _two_rank_checks(rank: int, world: int, root: str, four_rank_ckpt: str) -> None:
    queue = _example_flow(rank, world, os.path.join(root, "persistent"), persistent=True)
    _example_flow(rank, world, os.path.join(root, "forked"), persistent=False).close()

    resharded = _empty_like(_sharded_state(rank, world))
    dcp.load(resharded, checkpoint_id=four_rank_ckpt)
    rows = _ROWS // world
    assert torch.equal(resharded["dt"].to_local(), _full()[rank * rows : (rank + 1) * rows])

    _check_commit_fails_everywhere(queue, _model_state(rank, world), os.path.join(root, "bad"))
    queue.close()

    # Replicated state deduplicated to rank 0: rank 1 has nothing to write.
    path, replicated = os.path.join(root, "rank0_only"), {"only": torch.arange(7.0)}
    planner = DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    request = _plan_and_request(replicated, FileSystemWriterAsync(path), planner=planner)
    assert (request.async_fn is None) == (rank == 1)
    request.execute_sync()
    loaded = {"only": torch.zeros(7)}
    dcp.load(loaded, checkpoint_id=path)
    assert torch.equal(loaded["only"], replicated["only"])
    _check_cache(rank, world, _model_state(rank, world), root)


def test_two_ranks_example_flow_reshard_commit_and_cache(tmp_path, four_rank_run) -> None:
    four = os.path.join(four_rank_run[0], "sharded4")
    launch(_two_rank_checks, 2, str(tmp_path), four, timeout=200)
