"""Two ranks (gloo, CPU) saving asynchronously to object stores: the seed's example, retries
under injected faults, and failures that must raise everywhere and commit nothing.

The S3 server and the fault-injecting proxy run in the pytest process; the ranks and their
background workers are separate processes that reach them over loopback, configured by
the ``MSC_CONFIG`` and ``RESILIENT_CKPT_RETRY_*`` variables they inherit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import (
    CheckpointException,
    DefaultLoadPlanner,
    DefaultSavePlanner,
    load,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from resilient_ckpt.async_ckpt.cached_metadata_filesystem_reader import (
    CachedMetadataFileSystemReader,
)
from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from resilient_ckpt.async_ckpt.state_dict_saver import (
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from resilient_ckpt.async_ckpt.verify import verify_checkpoint
from resilient_ckpt.storage import get_backend
from resilient_ckpt.testing.launcher import launch

pytestmark = [pytest.mark.objstore, pytest.mark.dist, pytest.mark.timeout(180)]


def _model_state(rank: int, world: int) -> dict[str, Any]:
    """A replicated "model" (as model.state_dict() in the seed) plus a sharded tensor, so
    that both ranks have data objects to write."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    state: dict[str, Any] = dict(model.state_dict())
    mesh = init_device_mesh("cpu", (world,))
    full = torch.randn(8 * world, 5, generator=torch.Generator().manual_seed(1))
    state["sharded"] = DTensor.from_local(full[rank * 8 : (rank + 1) * 8].clone(), mesh, [Shard(0)])
    return state


def _zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, DTensor):
            local = torch.zeros_like(value.to_local())
            out[key] = DTensor.from_local(local, value.device_mesh, value.placements)
        else:
            out[key] = torch.zeros_like(value)
    return out


def _bit_exact(expected: dict[str, Any], actual: dict[str, Any]) -> None:
    for key, value in expected.items():
        a, b = (
            (value.to_local(), actual[key].to_local())
            if isinstance(value, DTensor)
            else (
                value,
                actual[key],
            )
        )
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), key


# -- the seed's example, as the NVRx documentation writes it ----------------------------------


def async_save_checkpoint(
    checkpoint_path: str, state_dict: dict, thread_count: int = 2, async_queue=None
):
    async_queue = async_queue or AsyncCallsQueue()
    writer = FileSystemWriterAsync(checkpoint_path, thread_count=thread_count, use_msc=True)
    coordinator_rank = 0
    planner = DefaultSavePlanner()
    save_state_dict_ret = save_state_dict_async_plan(
        state_dict, writer, None, coordinator_rank, planner=planner
    )
    save_fn, preload_fn, save_args = writer.get_save_function_and_args()

    def finalize_fn() -> None:
        save_state_dict_async_finalize(*save_state_dict_ret)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    async_request = AsyncRequest(save_fn, save_args, [finalize_fn], preload_fn=preload_fn)
    async_queue.schedule_async_request(async_request)
    return async_queue


def load_checkpoint(checkpoint_path: str, state_dict: dict) -> dict:
    import multistorageclient as msc

    reader = msc.torch.MultiStorageFileSystemReader(checkpoint_path, thread_count=2)
    load(state_dict=state_dict, storage_reader=reader, planner=DefaultLoadPlanner())
    return state_dict


def _seed_example(rank: int, world: int, checkpoint_path: str) -> list[str]:
    state_dict = _model_state(rank, world)
    async_queue = async_save_checkpoint(checkpoint_path, state_dict)
    backend = get_backend(checkpoint_path)
    # Until finalize commits, there is no metadata object: the checkpoint is invisible.
    assert not backend.exists(backend.join(checkpoint_path, ".metadata"))
    with pytest.raises((FileNotFoundError, CheckpointException)):
        load(
            _zeros_like(state_dict), storage_reader=CachedMetadataFileSystemReader(checkpoint_path)
        )
    dist.barrier()
    async_queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    async_queue.close()

    loaded_state_dict = load_checkpoint(checkpoint_path, _zeros_like(state_dict))
    _bit_exact(state_dict, loaded_state_dict)
    ours = _zeros_like(state_dict)
    load(ours, storage_reader=CachedMetadataFileSystemReader(checkpoint_path, thread_count=3))
    _bit_exact(state_dict, ours)
    assert verify_checkpoint(checkpoint_path).checksummed
    return backend.list(checkpoint_path)


def test_seed_example_two_ranks_bit_exact(msc_store) -> None:
    path = msc_store.url("iteration-0010")
    listed = launch(_seed_example, 2, path, timeout=150)
    assert listed[0] == listed[1]
    assert ".metadata" in listed[0]
    assert any(name.startswith("__0_") for name in listed[0])
    assert any(name.startswith("__1_") for name in listed[0])
    assert not any(name.endswith(".write_results") for name in listed[0])


# -- retries and failures, through the fault-injecting proxy ----------------------------------


def _save_and_load(queue: AsyncCallsQueue, path: str) -> None:
    state = _model_state(dist.get_rank(), dist.get_world_size())
    async_save_checkpoint(path, state, async_queue=queue)
    queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    loaded = _zeros_like(state)
    load(loaded, storage_reader=CachedMetadataFileSystemReader(path))
    _bit_exact(state, loaded)


def _transient(rank: int, world: int, path: str) -> None:
    queue = AsyncCallsQueue()
    try:
        _save_and_load(queue, path)
    finally:
        queue.close()


def test_transient_faults_are_retried(s3_store) -> None:
    """The first requests of a save (whatever they are: uploads, stats, downloads) fail with
    503 or a reset connection, in turn; the save retries them, commits and loads back.
    Fewer faults than the policy's 6 tries, so even one operation that takes them all
    succeeds."""
    s3_store.proxy.arm(("503", "reset"), count=5)
    launch(_transient, 2, s3_store.url("iteration-0001"), timeout=150)
    assert s3_store.proxy.injected == 5
    faults = [outcome for _, _, outcome in s3_store.proxy.requests()[:5]]
    assert faults == ["503", "reset", "503", "reset", "503"]
    assert "iteration-0001/.metadata" in s3_store.keys("iteration-0001")


def _expect_failure(queue: AsyncCallsQueue, path: str) -> str:
    state = _model_state(dist.get_rank(), dist.get_world_size())
    async_save_checkpoint(path, state, async_queue=queue)
    with pytest.raises(CheckpointException) as info:
        queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    return str(info.value)


def _persistent(rank: int, world: int, data_fails: str, commit_fails: str) -> list[str]:
    queue = AsyncCallsQueue()
    try:
        messages = [_expect_failure(queue, data_fails)]
        dist.barrier()
        messages.append(_expect_failure(queue, commit_fails))
    finally:
        queue.close()
    return messages


def test_persistent_faults_raise_on_every_rank_and_commit_nothing(s3_store) -> None:
    """Rank 1's data uploads always fail (503), or the metadata upload does (reset): every
    rank raises, naming the object and the last error, and no metadata object exists."""
    data_fails, commit_fails = s3_store.url("iteration-0003"), s3_store.url("iteration-0004")
    s3_store.proxy.arm(
        "503", None, match=lambda m, p: m == "PUT" and "iteration-0003/__1_" in p and "distcp" in p
    )
    s3_store.proxy.arm(
        "reset", None, match=lambda m, p: m == "PUT" and p.endswith("iteration-0004/.metadata")
    )
    results = launch(_persistent, 2, data_fails, commit_fails, timeout=150)
    for rank, (data_msg, commit_msg) in enumerate(results):
        assert f"{data_fails}/__1_" in data_msg, (rank, data_msg)
        assert "after 6 attempt(s)" in data_msg and "503" in data_msg, (rank, data_msg)
        assert f"{commit_fails}/.metadata" in commit_msg, (rank, commit_msg)
        assert "after 6 attempt(s)" in commit_msg, (rank, commit_msg)
    assert not any(k.endswith(".metadata") for k in s3_store.keys("iteration-0003"))
    assert not any(k.endswith(".metadata") for k in s3_store.keys("iteration-0004"))
    # every attempt reached the proxy: 6 per data object of rank 1, 6 for the metadata
    log = s3_store.proxy.requests()
    assert sum(1 for m, p, o in log if o == "reset" and p.endswith(".metadata")) == 6
