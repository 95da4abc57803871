"""``LocalCheckpointManager(weights_only=True)`` on two ranks with replication.

A rank whose copy is gone loads its shard from its clique peer and rebuilds it under the
allow-list; a user's class loads once marked safe (``torch.serialization.safe_globals``);
and a shard whose state names a global outside the allow-list (on one rank only) fails
the load on *every* rank with ``UnsafeCheckpointError`` naming the rank, the file and the
global, before anything runs, instead of leaving the other rank to go on alone.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest

from resilient_ckpt.errors import UnsafeCheckpointError
from resilient_ckpt.local import BasicTensorAwareStateDict
from resilient_ckpt.testing import launch
from tests._helpers import RunsCode, safe_globals

from .local_ckpt_utils import (
    assert_same,
    barrier,
    clone_state,
    load_fresh,
    make_state,
    manager,
    strategy,
    wipe,
)

pytestmark = pytest.mark.dist


@dataclasses.dataclass
class Schedule:
    warmup: int


def _ranks(rank: int, world_size: int, root: str) -> dict[str, Any]:
    facts: dict[str, Any] = {}
    repl = (1, 2)
    mgr = manager(root, strategy(repl), keep_latest=3)
    states = {it: make_state(rank, it) for it in (1, 2, 3)}
    states[2]["meta"]["schedule"] = Schedule(rank + 10)
    marker = os.path.join(root, f"ran-{rank}")
    if rank == 1:
        states[3]["meta"]["hook"] = RunsCode(marker)
    for iteration in (1, 2):
        mgr.save(BasicTensorAwareStateDict(clone_state(states[iteration])), iteration)
    # 1. rank 1 lost its directory: its shard comes from rank 0, rebuilt under the allow-list
    barrier()
    if rank == 1:
        wipe(root, 1)
    barrier()
    with safe_globals([Schedule]):
        latest, loaded = load_fresh(root, strategy(repl), weights_only=True)
    assert latest == 2, latest
    assert_same(states[2], loaded, f"rank {rank} iteration 2")
    facts["schedule"] = loaded["meta"]["schedule"]
    # 2. the same without Schedule allowed: refused on the ranks that hold it, every rank fails
    try:
        load_fresh(root, strategy(repl), weights_only=True)
    except UnsafeCheckpointError as exc:
        facts["unallowed"] = (type(exc).__name__, exc.name, str(exc))
    # 3. code in rank 1's shard only: every rank raises, nothing runs
    mgr = manager(root, strategy(repl), keep_latest=3)
    mgr.find_latest()
    mgr.save(BasicTensorAwareStateDict(clone_state(states[3])), 3)
    barrier()
    try:
        load_fresh(root, strategy(repl), weights_only=True)
    except UnsafeCheckpointError as exc:
        facts["refused"] = (exc.name, exc.path, str(exc))
    barrier()
    facts["ran"] = os.path.exists(marker)
    return facts


@pytest.mark.timeout(240)
def test_weights_only_load_with_replication(tmp_path):
    results = launch(_ranks, 2, str(tmp_path), timeout=180)
    for rank, facts in enumerate(results):
        assert facts["schedule"] == Schedule(rank + 10)
        kind, name, text = facts["unallowed"]
        assert kind == "RankUnsafeCheckpointError" and name.endswith("Schedule"), facts
        assert "failed on rank(s) [0, 1]" in text
        name, path, text = facts["refused"]
        assert name == "posix.mkdir" and "failed on rank(s) [1]" in text, text
        assert path == os.path.join(str(tmp_path), "sess", "1", "iter_0000003_1_local.pt")
        assert facts["ran"] is False
