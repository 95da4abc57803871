"""Recovery after a node loss forwards the lost shard while its replica is verified
(``local/replication/_forward``): the owner has its verified shard when ``find_latest``
returns, and ``load`` restores it exactly. A forwarded replica that is corrupt or truncated
is never used: the owner's own check rejects it, another replica serves the shard (at
three ranks) or the iteration is incomplete and an older one is restored; nobody hangs.
"""

from __future__ import annotations

import os
import shutil

import pytest

from resilient_ckpt.testing import launch

from .local_ckpt_utils import (
    LogCapture,
    assert_same,
    barrier,
    copy_path,
    flip_byte,
    manager,
    rank_dir,
    save_two,
    strategy,
)

pytestmark = [pytest.mark.dist, pytest.mark.fault, pytest.mark.timeout(240)]


def _truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 3)


def _lose_node(rank: int, base: str, lost: int, damage: dict[str, object]) -> None:
    """Rank ``lost``'s directory is gone; ``damage`` maps replica paths to what befalls them."""
    barrier()
    if rank == lost:
        shutil.rmtree(rank_dir(base, rank))
    for path, how in damage.items():
        if os.path.dirname(path) == rank_dir(base, rank):
            how(path)  # type: ignore[operator]
    barrier()


def _restore(base: str, strat: object) -> tuple[int, object, object]:
    mgr = manager(base, strat, keep_latest=2)
    latest = mgr.find_latest()
    had_own = mgr._ckpt_id(latest) in mgr._verified if latest != -1 else False
    state = mgr.load()[0].state_dict if latest != -1 else None
    return latest, state, had_own


def _two_ranks(rank: int, world: int, root: str) -> dict:
    log = LogCapture()
    strat = strategy((1, 2))
    facts: dict = {}

    base = os.path.join(root, "lost")
    states = save_two(rank, base, strat)
    _lose_node(rank, base, 1, {})
    latest, state, had_own = _restore(base, strat)
    assert latest == 20, latest
    assert_same(states[20], state, f"rank {rank}: after the node loss")
    facts["forwarded_before_load"] = had_own
    facts["forward_logged"] = any("forwarding the replica" in m for m in log.messages)

    for name, how in (("corrupt", flip_byte), ("truncated", _truncate)):
        base = os.path.join(root, name)
        states = save_two(rank, base, strat)
        log.messages.clear()
        _lose_node(rank, base, 1, {copy_path(base, 0, 20, 1): how})
        latest, state, _ = _restore(base, strat)
        assert latest == 10, f"{name} replica: iteration 20 must not be complete"
        assert_same(states[10], state, f"rank {rank}: {name} replica, fallback to 10")
        facts[f"{name}_rejected"] = any("does not match its manifest" in m for m in log.messages)
    return facts


def test_lost_shard_is_forwarded_while_verified_and_bad_replicas_are_rejected(tmp_path):
    facts = launch(_two_ranks, 2, str(tmp_path), timeout=200)
    assert facts[1]["forwarded_before_load"], "rank 1's shard was not forwarded by find_latest"
    assert facts[0]["forward_logged"], "rank 0 did not forward rank 1's replica"
    assert facts[1]["corrupt_rejected"], "rank 1 did not reject the corrupt forward"
    # (A truncated replica is already left out by the catalogue scan: nothing is forwarded.)


def _three_ranks(rank: int, world: int, root: str) -> bool:
    strat = strategy((1, 3))  # one clique {0, 1, 2}: every rank holds every shard
    base = os.path.join(root, "three")
    states = save_two(rank, base, strat)
    # Rank 1 is lost; rank 0 (the designated forwarder) holds a corrupt replica of it.
    _lose_node(rank, base, 1, {copy_path(base, 0, 20, 1): flip_byte})
    latest, state, had_own = _restore(base, strat)
    assert latest == 20, latest
    assert_same(states[20], state, f"rank {rank}: shard 1 from rank 2's replica")
    assert not (rank == 1 and had_own), "a corrupt forward was kept"
    return True


def test_a_corrupt_forward_falls_back_to_anothercopy_path(tmp_path):
    assert launch(_three_ranks, 3, str(tmp_path), timeout=200) == [True] * 3
