"""Arena placement: host storages close in memory mirrored and copied as one range."""

from __future__ import annotations

import random

import pytest
import torch

from resilient_ckpt.async_ckpt._copy import ALIGN, BRIDGE_MAX_BYTES, place
from resilient_ckpt.async_ckpt._staging import ArenaPool, stage, unstage
from resilient_ckpt.async_ckpt._structure import StageCache

PAGE = 4096


def _never() -> bool:
    return False


def _random_storages(rng: random.Random) -> list[tuple[int | None, int]]:
    """Storages as a CPU allocator leaves them: mostly increasing, with headers between
    them, sometimes far apart, sometimes overlapping (two storage objects over one buffer),
    beside device and empty storages."""
    out: list[tuple[int | None, int]] = []
    address = rng.randrange(1 << 20, 1 << 30) * ALIGN
    for _ in range(rng.randrange(1, 60)):
        kind = rng.random()
        nbytes = rng.choice([0, 1, 8, 100, 4096, 32768, rng.randrange(1, 200_000)])
        if kind < 0.08:
            out.append((None, nbytes))
            continue
        if kind < 0.15 and out and out[-1][0] is not None:
            previous, size = out[-1]
            out.append((previous + rng.randrange(0, max(size, 1)), nbytes))
            continue
        address += rng.choice([0, 16, 64, 320, 448, 1000, 5000, 1 << 20])
        out.append((address, nbytes))
        address += nbytes
    rng.shuffle(out)
    return out


def test_place_mirrors_runs_and_keeps_every_storage_separate() -> None:
    rng = random.Random(7)
    for _ in range(400):
        storages = _random_storages(rng)
        placement = place(storages)
        offsets = placement.offsets
        runs = placement.runs
        # Runs: in address order, disjoint in the arena, each gap under a page.
        for (dst_a, src_a, n_a), (dst_b, src_b, _) in zip(runs, runs[1:], strict=False):
            assert src_a + n_a < src_b and dst_a + n_a <= dst_b
        for index, (address, nbytes) in enumerate(storages):
            if address is None or nbytes == 0:
                continue
            # Inside exactly one run, at the source's place relative to the run's start.
            (run,) = [r for r in runs if r[1] <= address and address + nbytes <= r[1] + r[2]]
            assert offsets[index] == run[0] + address - run[1]
            assert offsets[index] % ALIGN == address % ALIGN
        for dst, src, n in runs:
            covered = sorted(
                (a, a + b) for a, b in storages if a is not None and b and src <= a < src + n
            )
            end = src
            for lo, hi in covered:
                assert lo - end <= BRIDGE_MAX_BYTES < PAGE  # every copied gap is safe to read
                end = max(end, hi)
            assert end == src + n and dst + n <= placement.total
        # Device and empty storages: after the runs, aligned, disjoint.
        ends = [dst + n for dst, _, n in runs]
        tail = sorted(
            (offsets[i], nbytes)
            for i, (address, nbytes) in enumerate(storages)
            if address is None or nbytes == 0
        )
        cursor = max(ends, default=0)
        for offset, nbytes in tail:
            assert offset % ALIGN == 0 and offset >= cursor
            cursor = offset + nbytes
        assert cursor <= placement.total
        # The arena grows by at most an eighth of the bytes, plus alignment.
        payload = sum(n for _, n in storages)
        assert placement.total <= payload * 9 // 8 + 2 * ALIGN * (len(runs) + len(tail) + 1)


def test_far_apart_and_tiny_storages_are_not_bridged() -> None:
    # 1 MB apart: two runs. 8-byte storages 320 bytes apart: a gap of 40x the bytes
    # would grow the arena, so each is a run of its own.
    assert len(place([(1 << 30, 4096), ((1 << 30) + (1 << 20), 4096)]).runs) == 2
    tiny = [((1 << 30) + k * 328, 8) for k in range(10)]
    assert len(place(tiny).runs) == 10
    near = [((1 << 30) + k * (32768 + 320), 32768) for k in range(10)]
    assert len(place(near).runs) == 1


@pytest.mark.parametrize("threads", [1, 3])
def test_consecutive_tensors_round_trip_staged_in_full_and_again(threads: int) -> None:
    """(That they are copied as far fewer ranges than storages is in
    ``test_performance_contract.py``.)"""
    # ~10 MB: above PARALLEL_MIN_BYTES, so with 3 threads the runs are cut into shares.
    tensors = [torch.randn(8000 + k) for k in range(300)]
    base = torch.arange(64, dtype=torch.float64)
    state = {
        "params": tensors,
        "view": base[8:16],
        "base": base,
        "int": torch.arange(5, dtype=torch.int16),
        "noncontig": torch.randn(6, 4).t(),
    }
    expected = {k: [t.clone() for t in v] if k == "params" else v.clone() for k, v in state.items()}
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
        for key in ("view", "base", "int", "noncontig"):
            assert torch.equal(out[key], expected[key]), key
        assert out["view"].untyped_storage().data_ptr() == out["base"].untyped_storage().data_ptr()
        assert staged.arena is not None
        pool.release(staged.arena.arena_id)
        expected = {
            k: [t.clone() for t in v] if k == "params" else v.clone() for k, v in state.items()
        }
        del out
    pool.close()
