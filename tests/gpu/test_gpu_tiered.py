"""Tiered checkpoints of CUDA state (runs only with a GPU): each save snapshots device memory
before it returns, and ``load`` restores into CUDA tensors from either tier."""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest
import torch

from resilient_ckpt.testing import launch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]


def _state(fill: float | None = None) -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    model = {"w": torch.randn(1024, 64, generator=g), "b": torch.randn(64, generator=g)}
    if fill is not None:
        model = {k: torch.full_like(v, fill) for k, v in model.items()}
    return {"model": {k: v.cuda() for k, v in model.items()}, "step": 0}


def _restore(root: str) -> tuple[dict[str, Any], dict[str, Any] | None, int | None]:
    from resilient_ckpt.tiered import TieredCheckpointManager

    mgr = TieredCheckpointManager(
        os.path.join(root, "mem"), os.path.join(root, "durable"), replication_factor=1
    )
    target = _state(fill=0.0)
    step = mgr.load(target)
    restore = mgr.last_restore
    mgr.close()
    return target, restore, step


def _round_trip(rank: int, world: int, root: str) -> dict[str, Any]:
    from resilient_ckpt.tiered import TieredCheckpointManager

    state = _state()
    expected = {k: (v + 1).cpu() for k, v in state["model"].items()}
    mgr = TieredCheckpointManager(
        os.path.join(root, "mem"),
        os.path.join(root, "durable"),
        replication_factor=1,
        durable_every=2,
    )
    mgr.save(state, 1)
    for v in state["model"].values():
        v.add_(1)
    mgr.save(state, 2)  # the second save also goes durable
    for v in state["model"].values():
        v.add_(1)  # after the save returned: not in the checkpoint
    mgr.maybe_finalize(blocking=True)
    mgr.close()

    facts: dict[str, Any] = {}
    for tier in ("memory", "durable"):
        if tier == "durable":
            shutil.rmtree(os.path.join(root, "mem"))  # the node's memory is gone
        target, restore, step = _restore(root)
        facts[tier] = {
            "step": step,
            "tier": (restore or {}).get("tier"),
            "on_cuda": all(v.is_cuda for v in target["model"].values()),
            "exact": all(torch.equal(target["model"][k].cpu(), expected[k]) for k in expected),
        }
    return facts


def test_cuda_state_saves_and_restores_from_both_tiers(tmp_path) -> None:
    (facts,) = launch(_round_trip, 1, str(tmp_path), timeout=150)
    for tier in ("memory", "durable"):
        assert facts[tier] == {"step": 2, "tier": tier, "on_cuda": True, "exact": True}, facts
