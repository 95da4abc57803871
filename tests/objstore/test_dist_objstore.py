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

from resilient_ckpt._torch_compat import DTensor, Shard
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


def _seed_example(
    checkpoint_path: str, state_dict: dict, async_queue: AsyncCallsQueue | None
) -> tuple[AsyncCallsQueue, list[str]]:
    async_queue = async_save_checkpoint(checkpoint_path, state_dict, async_queue=async_queue)
    backend = get_backend(checkpoint_path)
    # Until finalize commits, there is no metadata object: the checkpoint is invisible.
    assert not backend.exists(backend.join(checkpoint_path, ".metadata"))
    with pytest.raises((FileNotFoundError, CheckpointException)):
        load(
            _zeros_like(state_dict), storage_reader=CachedMetadataFileSystemReader(checkpoint_path)
        )
    dist.barrier()
    async_queue.maybe_finalize_async_calls(blocking=True, no_dist=False)

    loaded_state_dict = load_checkpoint(checkpoint_path, _zeros_like(state_dict))
    _bit_exact(state_dict, loaded_state_dict)
    ours = _zeros_like(state_dict)
    load(ours, storage_reader=CachedMetadataFileSystemReader(checkpoint_path, thread_count=3))
    _bit_exact(state_dict, ours)
    assert verify_checkpoint(checkpoint_path).checksummed
    return async_queue, backend.list(checkpoint_path)


def _seed_examples(rank: int, world: int, paths: list[str]) -> list[list[str]]:
    """The seed's example once per path, on one queue (as a training job saving twice)."""
    state_dict = _model_state(rank, world)
    queue, listed = None, []
    try:
        for path in paths:
            queue, names = _seed_example(path, state_dict, queue)
            listed.append(names)
    finally:
        if queue is not None:
            queue.close()
    return listed


def test_seed_example_two_ranks_bit_exact(s3_and_posix_stores) -> None:
    """On the S3 server and on MSC's POSIX provider, in one launch (launches are the cost)."""
    paths = [store.url("iteration-0010") for store in s3_and_posix_stores]
    per_rank = launch(_seed_examples, 2, paths, timeout=170)
    assert per_rank[0] == per_rank[1]
    for store, listed in zip(s3_and_posix_stores, per_rank[0], strict=True):
        assert ".metadata" in listed, store.kind
        assert any(name.startswith("__0_") for name in listed), store.kind
        assert any(name.startswith("__1_") for name in listed), store.kind
        assert all(name.endswith((".distcp", ".metadata")) for name in listed), store.kind
        assert "iteration-0010/.metadata" in store.keys("iteration-0010"), store.kind


# -- retries and failures, through the fault-injecting proxy ----------------------------------


def _save_and_load(queue: AsyncCallsQueue, path: str) -> None:
    state = _model_state(dist.get_rank(), dist.get_world_size())
    async_save_checkpoint(path, state, async_queue=queue)
    queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    loaded = _zeros_like(state)
    load(loaded, storage_reader=CachedMetadataFileSystemReader(path))
    _bit_exact(state, loaded)


def _expect_failure(queue: AsyncCallsQueue, path: str) -> str:
    state = _model_state(dist.get_rank(), dist.get_world_size())
    async_save_checkpoint(path, state, async_queue=queue)
    with pytest.raises(CheckpointException) as info:
        queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    return str(info.value)


def _faults(rank: int, world: int, ok: str, data_fails: str, commit_fails: str) -> list[str]:
    """One launch for all three saves (a launch costs more than the saves): transient
    faults that must be retried, then two persistent ones that must fail everywhere."""
    queue = AsyncCallsQueue()
    try:
        _save_and_load(queue, ok)
        dist.barrier()
        messages = [_expect_failure(queue, data_fails)]
        dist.barrier()
        messages.append(_expect_failure(queue, commit_fails))
    finally:
        queue.close()
    return messages


def test_transient_faults_are_retried_persistent_ones_raise_everywhere(s3_store) -> None:
    """Transient: the first requests of a save to iteration-0001 (whatever they are: uploads,
    stats, downloads) fail with 503 or a reset connection, in turn; the save retries them,
    commits and loads back (fewer faults than the policy's 6 tries, so even one operation
    that takes them all succeeds). Persistent: rank 1's data uploads to iteration-0003
    always fail (503), or the metadata upload of iteration-0004 does (reset): every rank
    raises, naming the object and the last error, and no metadata object exists."""
    ok = s3_store.url("iteration-0001")
    data_fails, commit_fails = s3_store.url("iteration-0003"), s3_store.url("iteration-0004")
    transient = s3_store.proxy.arm(
        ("503", "reset"), count=5, match=lambda m, p: "iteration-0001" in p
    )
    s3_store.proxy.arm(
        "503", None, match=lambda m, p: m == "PUT" and "iteration-0003/__1_" in p and "distcp" in p
    )
    s3_store.proxy.arm(
        "reset", None, match=lambda m, p: m == "PUT" and p.endswith("iteration-0004/.metadata")
    )
    results = launch(_faults, 2, ok, data_fails, commit_fails, timeout=170)

    assert transient.injected == 5
    log = s3_store.proxy.requests()
    first = [outcome for _, p, outcome in log if "iteration-0001" in p][:5]
    assert first == ["503", "reset", "503", "reset", "503"]
    assert "iteration-0001/.metadata" in s3_store.keys("iteration-0001")

    for rank, (data_msg, commit_msg) in enumerate(results):
        assert f"{data_fails}/__1_" in data_msg, (rank, data_msg)
        assert "after 6 attempt(s)" in data_msg and "503" in data_msg, (rank, data_msg)
        assert f"{commit_fails}/.metadata" in commit_msg, (rank, commit_msg)
        assert "after 6 attempt(s)" in commit_msg, (rank, commit_msg)
    assert not any(k.endswith(".metadata") for k in s3_store.keys("iteration-0003"))
    assert not any(k.endswith(".metadata") for k in s3_store.keys("iteration-0004"))
    # every attempt of the commit reached the proxy: the policy's 6 tries
    assert sum(1 for _, p, o in log if o == "reset" and p.endswith("0004/.metadata")) == 6
