"""The three save flows under an NCCL default process group with CUDA state (runs only with
a GPU; one rank, since NCCL takes one device per rank): async DCP through the persistent
queue, a local checkpoint with its replication strategy, and a tiered save, each restored
into CUDA tensors bit for bit. The library's own agreements must not depend on gloo being
the default backend."""

from __future__ import annotations

import functools
import os
import warnings
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from resilient_ckpt.testing import launch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240)]

BACKEND, DEVICE = "nccl", "cuda"


def _tensors(fill: float | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    out = {"w": torch.randn(512, 33, generator=g), "b": torch.randn(33, generator=g)}
    if fill is not None:
        out = {k: torch.full_like(v, fill) for k, v in out.items()}
    return {k: v.to(DEVICE) for k, v in out.items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].device.type == DEVICE and torch.equal(a[k].cpu(), b[k].cpu()) for k in a
    )


def _dcp(root: str) -> bool:
    import torch.distributed.checkpoint as dcp

    from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
    from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
    from resilient_ckpt.async_ckpt.state_dict_saver import (
        save_state_dict_async_finalize,
        save_state_dict_async_plan,
    )

    state, expected = _tensors(), _tensors()
    queue = AsyncCallsQueue()
    try:
        writer = FileSystemWriterAsync(os.path.join(root, "dcp"))
        ret = save_state_dict_async_plan(state, writer)
        save_fn, preload_fn, args = writer.get_save_function_and_args()
        finalize = functools.partial(save_state_dict_async_finalize, *ret)
        queue.schedule_async_request(AsyncRequest(save_fn, args, [finalize], preload_fn=preload_fn))
        for v in state.values():
            v.add_(1)  # after scheduling: not in the checkpoint
        queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    finally:
        queue.close()
    loaded = _tensors(fill=0.0)
    dcp.load(loaded, checkpoint_id=os.path.join(root, "dcp"))
    return _equal(loaded, expected)


def _local(root: str) -> bool:
    from resilient_ckpt.async_ckpt.core import AsyncCallsQueue
    from resilient_ckpt.local import BasicTensorAwareStateDict, LocalCheckpointManager
    from resilient_ckpt.local.replication.strategies import CliqueReplicationStrategy

    state, expected = _tensors(), _tensors()
    # A clique of this one rank over the default backend (NCCL): the strategy's exchange
    # runs, with no peer to send to.
    strategy = CliqueReplicationStrategy.from_replication_params(1, 1)
    mgr = LocalCheckpointManager(os.path.join(root, "local"), "job", repl_strategy=strategy)
    queue = AsyncCallsQueue()
    try:
        queue.schedule_async_request(mgr.save(BasicTensorAwareStateDict(state), 5, is_async=True))
        for v in state.values():
            v.add_(1)
        queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()
    reader = LocalCheckpointManager(os.path.join(root, "local"), "job", repl_strategy=strategy)
    if reader.find_latest() != 5:
        return False
    loaded, _ = reader.load()
    return _equal(loaded.state_dict, expected)


def _tiered(root: str) -> bool:
    from resilient_ckpt.tiered import TieredCheckpointManager

    state, expected = {"model": _tensors()}, {"model": _tensors()}
    dirs = (os.path.join(root, "mem"), os.path.join(root, "durable"))
    mgr = TieredCheckpointManager(*dirs, replication_factor=1, durable_every=1)
    mgr.save(state, 1)
    for v in state["model"].values():
        v.add_(1)
    mgr.maybe_finalize(blocking=True)
    mgr.close()
    reader = TieredCheckpointManager(*dirs, replication_factor=1)
    loaded = {"model": _tensors(fill=0.0)}
    step = reader.load(loaded)
    reader.close()
    return step == 1 and _equal(loaded["model"], expected["model"])


def _all_flows(rank: int, world: int, root: str) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    if DEVICE == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        BACKEND,
        init_method=f"file://{os.path.join(root, 'store')}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    try:
        return {"dcp": _dcp(root), "local": _local(root), "tiered": _tiered(root)}
    finally:
        dist.destroy_process_group()


def test_save_flows_under_an_nccl_process_group(tmp_path) -> None:
    (facts,) = launch(_all_flows, 1, str(tmp_path), timeout=200, process_group=False)
    assert facts == {"dcp": True, "local": True, "tiered": True}
