"""What a new user of ``TieredCheckpointManager`` meets first (issue 47, point 4): its
defaults on one node say how to fix themselves, and ``last_restore`` exists on a fresh
start."""

from __future__ import annotations

import os

import pytest
import torch

from resilient_ckpt.errors import ConfigurationError
from resilient_ckpt.testing import launch
from resilient_ckpt.tiered import TieredCheckpointManager

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]


def _defaults_on_one_node(rank: int, world: int, root: str) -> str:
    try:
        TieredCheckpointManager(os.path.join(root, "mem"), os.path.join(root, "durable"))
    except ConfigurationError as exc:
        return str(exc)
    return "no error"


def test_the_defaults_on_one_node_name_the_fix(tmp_path) -> None:
    messages = launch(_defaults_on_one_node, 2, str(tmp_path), env={"LOCAL_WORLD_SIZE": "2"})
    for message in messages:
        assert "divisible by jump*factor=4" in message
        assert "replication_jump=1" in message and "LOCAL_WORLD_SIZE" in message


def _fresh_start(rank: int, world: int, root: str) -> tuple:
    manager = TieredCheckpointManager(
        os.path.join(root, "mem"), os.path.join(root, "durable"), replication_jump=1
    )
    before = manager.last_restore
    state = {"w": torch.zeros(4)}
    step = manager.load(state)
    after_nothing = manager.last_restore
    manager.save({"w": torch.ones(4)}, 1, durable=True)
    manager.maybe_finalize(blocking=True)
    manager.close()
    again = TieredCheckpointManager(
        os.path.join(root, "mem"), os.path.join(root, "durable"), replication_jump=1
    )
    restored = again.load(state)
    report = again.last_restore or {}
    again.close()
    return before, step, after_nothing, restored, report.get("step")


def test_last_restore_is_none_until_a_load_restores(tmp_path) -> None:
    results = launch(_fresh_start, 2, str(tmp_path), timeout=150)
    assert results == [(None, None, None, 1, 1)] * 2
