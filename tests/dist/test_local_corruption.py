"""Corrupt local checkpoint files are detected by checksum and never loaded.

One flipped byte in a rank's own file: the replica is used (and the log names the bad
file). No valid copy of some shard: the iteration is not complete, ``find_latest`` falls
back to the older retained iteration, then to -1. Without replication a corrupt or
truncated own file makes the iteration incomplete just the same.
"""

from __future__ import annotations

import os

import pytest

from resilient_ckpt.testing import launch

from .local_ckpt_utils import (
    LogCapture,
    assert_same,
    barrier,
    copy_path,
    flip_byte,
    listing,
    load_fresh,
    save_two,
    strategy,
)

pytestmark = [pytest.mark.dist, pytest.mark.fault]


def _damage(rank: int, paths_by_rank: dict[int, list[str]], how=flip_byte) -> None:
    barrier()
    for path in paths_by_rank.get(rank, []):
        how(path)
    barrier()


def _replicated(rank: int, root: str, log: LogCapture) -> None:
    base = os.path.join(root, "repl")
    strat = strategy((1, 2))  # cliques {0, 1} and {2, 3}
    states = save_two(rank, base, strat)

    bad = copy_path(base, 1, 20, 1)
    _damage(rank, {1: [bad]})
    latest, loaded = load_fresh(base, strat, keep_latest=2)
    assert latest == 20
    assert_same(states[20], loaded, f"rank {rank}: shard from the replica")
    if rank == 1:
        assert any(bad in m and "checksum mismatch" in m for m in log.messages), log.messages

    _damage(rank, {2: [copy_path(base, 2, 20, 2)], 3: [copy_path(base, 3, 20, 2)]})
    latest, loaded = load_fresh(base, strat, keep_latest=2)
    assert latest == 10, "no valid copy of shard 2: iteration 20 must not be complete"
    assert_same(states[10], loaded, f"rank {rank}: fallback to iteration 10")
    assert not any(name.startswith(f"iter_{20:07d}") for name in listing(base))

    _damage(rank, {0: [copy_path(base, 0, 10, 0)], 1: [copy_path(base, 1, 10, 0)]})
    assert load_fresh(base, strat, keep_latest=2)[0] == -1


def _truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1)


def _unreplicated(rank: int, root: str) -> None:
    base = os.path.join(root, "plain")
    states = save_two(rank, base, None)
    _damage(rank, {3: [copy_path(base, 3, 20, 3)]})
    latest, loaded = load_fresh(base, None, keep_latest=2)
    assert latest == 10
    assert_same(states[10], loaded, f"rank {rank}: fallback without replication")
    _damage(rank, {0: [copy_path(base, 0, 10, 0)]}, how=_truncate)
    assert load_fresh(base, None, keep_latest=2)[0] == -1


def _corruption(rank: int, world_size: int, root: str) -> bool:
    log = LogCapture()
    _replicated(rank, root, log)
    _unreplicated(rank, root)
    return True


def test_corrupt_files_fall_back_to_replicas_then_older_iterations(tmp_path):
    assert launch(_corruption, 4, str(tmp_path), timeout=150) == [True] * 4
