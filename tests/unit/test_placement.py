"""Arena placement: every storage in a slot of its own, back to back, aligned; its bytes
copied there once, whole states split over the copy threads."""

from __future__ import annotations

import random

import pytest
import torch

from resilient_ckpt.async_ckpt._copy import ALIGN, place
from resilient_ckpt.async_ckpt._stage_cache import StageCache
from resilient_ckpt.async_ckpt._staging import ArenaPool, stage, unstage


def _never() -> bool:
    return False


def _random_storages(rng: random.Random) -> list[tuple[int | None, int]]:
    """Host storages anywhere (also overlapping ones), device storages, empty ones."""
    out: list[tuple[int | None, int]] = []
    for _ in range(rng.randrange(1, 60)):
        nbytes = rng.choice([0, 1, 8, 100, 4096, 32768, rng.randrange(1, 200_000)])
        if rng.random() < 0.1:
            out.append((None, nbytes))
        elif out and out[-1][0] is not None and rng.random() < 0.1:
            out.append((out[-1][0] + rng.randrange(0, max(out[-1][1], 1)), nbytes))
        else:
            out.append((rng.randrange(1 << 20, 1 << 40), nbytes))
    return out


def test_each_storage_has_its_own_aligned_slot_and_one_host_copy() -> None:
    rng = random.Random(7)
    for _ in range(400):
        storages = _random_storages(rng)
        placement = place(storages)
        slots = list(zip(placement.offsets, (n for _, n in storages), strict=True))
        # In the order met, aligned, disjoint, inside the arena, no more room than alignment.
        assert [offset for offset, _ in slots] == sorted(offset for offset, _ in slots)
        for (offset, nbytes), (after, _) in zip(slots, slots[1:], strict=False):
            assert offset + nbytes <= after
        assert all(offset % ALIGN == 0 for offset, _ in slots)
        assert slots[-1][0] + slots[-1][1] <= placement.total
        assert placement.total <= sum(n + ALIGN - 1 for _, n in storages)
        # One copy per non-empty host storage: its own bytes into its own slot.
        assert list(placement.host) == [
            (offset, address, nbytes)
            for (address, nbytes), (offset, _) in zip(storages, slots, strict=True)
            if address is not None and nbytes
        ]


def _clone(state: dict) -> dict:
    return {k: [t.clone() for t in v] if k == "params" else v.clone() for k, v in state.items()}


@pytest.mark.parametrize("threads", [1, 3])
def test_tensors_round_trip_through_their_own_slots(threads: int) -> None:
    # ~10 MB: above PARALLEL_MIN_BYTES, so with 3 threads the copies are cut into shares.
    tensors = [torch.randn(8000 + k) for k in range(300)]
    base = torch.arange(64, dtype=torch.float64)
    state = {
        "params": tensors,
        "tied": tensors[7],
        "view": base[8:16],
        "base": base,
        "int": torch.arange(5, dtype=torch.int16),
        "noncontig": torch.randn(6, 4).t(),
        "empty": torch.empty(0),
    }
    expected = _clone(state)
    pool = ArenaPool(2)
    cache = StageCache()
    for _ in range(3):  # a full staging, then two through the cache's plan
        staged = stage(state, pool, _never, cache=cache, threads=threads)
        for t in tensors:
            t.add_(1)  # training goes on: the snapshot must not change
        base.add_(1)
        out = unstage(staged.payload, staged.arena, staged.slots)
        for got, want in zip(out["params"], expected["params"], strict=True):
            assert torch.equal(got, want)
        for key in ("tied", "view", "base", "int", "noncontig", "empty"):
            assert torch.equal(out[key], expected[key]), key
        # Tensors sharing a storage share its slot; every other storage has its own.
        assert out["view"].untyped_storage().data_ptr() == out["base"].untyped_storage().data_ptr()
        tied = out["tied"].untyped_storage().data_ptr()
        assert tied == out["params"][7].untyped_storage().data_ptr()
        own = [*out["params"], out["base"], out["int"], out["noncontig"]]
        ranges = sorted(
            {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in own}
        )
        assert len(ranges) == len(own)
        for (start, nbytes), (after, _) in zip(ranges, ranges[1:], strict=False):
            assert start + nbytes <= after
        assert all(start % ALIGN == 0 for start, _ in ranges)
        assert staged.arena is not None
        pool.release(staged.arena.arena_id)
        expected = _clone(state)
        del out
    assert cache.hits == 2
    _assert_shares_fill_every_slot_once(cache, staged.slots, threads)
    pool.close()


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(start, bytes)`` ranges as sorted ``[start, end)`` intervals, touching ones joined;
    asserts that none overlap."""
    out: list[tuple[int, int]] = []
    for start, nbytes in sorted(ranges):
        if out:
            assert out[-1][1] <= start  # no byte twice
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], start + nbytes)
        else:
            out.append((start, start + nbytes))
    return out


def _assert_shares_fill_every_slot_once(cache: StageCache, slots, threads: int) -> None:
    """The cached copy plan, split over the threads, writes each slot's bytes exactly once."""
    shares = cache._shares
    assert len(shares) == threads
    written = _merged([(dst, n) for share in shares for dst, _, n in share])
    assert written == _merged([(offset, nbytes) for offset, nbytes in slots if nbytes])
