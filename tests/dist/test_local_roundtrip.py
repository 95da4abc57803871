"""Local checkpoints round-trip bit-exact on 4, 6 and 8 gloo ranks, and survive node loss.

Each launch runs several replication setups in turn (separate directories, one set of
process groups each), saving through the synchronous path, the persistent queue and the
fork queue, across the 7-to-8-digit iteration boundary. After the last save, the whole
directories of F-1 members of every clique are deleted; a fresh manager still finds the
iteration on every rank and loads bit-exact state, the lost shards coming from peers.
"""

from __future__ import annotations

import os

import pytest

from resilient_ckpt.local.replication.group_utils import parse_group_sequence
from resilient_ckpt.testing import launch

from .local_ckpt_utils import (
    Repl,
    Saver,
    assert_same,
    barrier,
    clone_state,
    listing,
    load_fresh,
    make_state,
    manager,
    strategy,
    wipe,
)

pytestmark = pytest.mark.dist

FIRST_ITERATION = 9_999_998  # crosses into 8 digits


def _victims(repl: Repl, world_size: int, attempt: int) -> list[int]:
    """F-1 members of every clique; which member survives varies with the clique."""
    if repl is None:
        return []
    jump, factor = repl
    victims = []
    for index, clique in enumerate(parse_group_sequence(jump, factor, world_size)):
        survivor = clique[(index + attempt) % factor]
        victims.extend(r for r in clique if r != survivor)
    return victims


def _node_loss(
    rank: int, world_size: int, base: str, strat: object, repl: Repl, it: int, expected: object
) -> None:
    victims = _victims(repl, world_size, attempt=it)
    barrier()
    if rank in victims:
        wipe(base, rank)
    barrier()
    latest, loaded = load_fresh(base, strat)
    assert latest == it, f"rank {rank}: find_latest {latest} after losing {victims}"
    assert_same(expected, loaded, f"rank {rank} after losing ranks {victims}")


def _scenario(rank: int, world_size: int, root: str, configs: list[Repl], modes: list[str]):
    saver = Saver()
    listings = []
    try:
        for index, repl in enumerate(configs):
            base = os.path.join(root, f"cfg{index}")
            strat = strategy(repl)
            mgr = manager(base, strat)
            assert mgr.find_latest() == -1
            for k, mode in enumerate(modes):
                iteration = FIRST_ITERATION + k
                state = make_state(rank, iteration)
                expected = clone_state(state)
                saver.save(mgr, state, iteration, mode)
                latest, loaded = load_fresh(base, strat)
                assert latest == iteration, (mode, latest, iteration)
                assert_same(expected, loaded, f"rank {rank} {repl} {mode}")
            listings.append(listing(base))
            if repl is not None:
                _node_loss(rank, world_size, base, strat, repl, iteration, expected)
                # The recovered job saves again: lost directories are recreated.
                state = make_state(rank, iteration + 1)
                saver.save(mgr, clone_state(state), iteration + 1, "sync")
                latest, loaded = load_fresh(base, strat)
                assert latest == iteration + 1
                assert_same(state, loaded, f"rank {rank} {repl} save after recovery")
    finally:
        saver.close()
    return listings


def _check_listings(listings: list[list[list[str]]], configs: list[Repl], n_modes: int) -> None:
    last = FIRST_ITERATION + n_modes - 1
    for rank, per_config in enumerate(listings):
        for repl, names in zip(configs, per_config, strict=True):
            copies = 1 if repl is None else repl[1]
            assert len(names) == 2 * copies, (rank, repl, names)  # data + manifest per copy
            assert all(n.startswith(f"iter_{last}_") for n in names), names  # retention


def test_roundtrip_4_ranks(tmp_path):
    configs: list[Repl] = [None, (1, 2), (2, 2)]
    modes = ["sync", "persistent", "fork"]
    listings = launch(_scenario, 4, str(tmp_path), configs, modes, timeout=170)
    _check_listings(listings, configs, len(modes))


def test_roundtrip_6_ranks_factor_3(tmp_path):
    configs: list[Repl] = [(1, 3), (2, 3)]
    modes = ["sync", "fork"]
    listings = launch(_scenario, 6, str(tmp_path), configs, modes, timeout=170)
    _check_listings(listings, configs, len(modes))


def test_roundtrip_8_ranks(tmp_path):
    configs: list[Repl] = [(2, 2), (1, 4)]
    modes = ["sync", "fork"]
    listings = launch(_scenario, 8, str(tmp_path), configs, modes, timeout=170)
    _check_listings(listings, configs, len(modes))
