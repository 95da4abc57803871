"""Crash safety: a rank killed during an async save leaves the previous iteration intact.

Launch 1 saves iteration k, then starts an async save of k+1 on the persistent queue whose
write is followed by a long sleep; once every rank has written its (dirty) files, rank 2's
trainer kills itself with SIGKILL (its worker dies with it), and the launcher tears the
job down. Launch 2 ("after restart") finds k on every rank, loads it bit-exact, and no
dirty file is left. It then loses a *worker* during an async save of k+1: every rank gets
the error, nothing is committed, and k is still the latest.
"""

from __future__ import annotations

import functools
import os
import signal
import time

import pytest

from resilient_ckpt.async_ckpt.core import AsyncCallsQueue
from resilient_ckpt.errors import WorkerError
from resilient_ckpt.local import BasicTensorAwareStateDict
from resilient_ckpt.testing import RankFailure, RankTimeout, launch

from .local_ckpt_utils import (
    assert_same,
    barrier,
    clone_state,
    listing,
    load_fresh,
    make_state,
    manager,
    strategy,
)

pytestmark = [pytest.mark.dist, pytest.mark.fault]

K = 100
VICTIM = 2


def write_then_stall(async_fn, marker: str, *args) -> None:
    """async_fn wrapper: finish the save's background part, say so, then hang (slow disk)."""
    async_fn(*args)
    with open(marker, "w"):
        pass
    time.sleep(600)


def write_then_die(async_fn, victim: int, rank: int, *args) -> None:
    """async_fn wrapper: the worker of ``victim`` dies once the dirty files are written."""
    async_fn(*args)
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)


def _wait_for(paths: list[str], deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"markers {paths} did not appear")
        time.sleep(0.05)


def _first_run(rank: int, world_size: int, root: str, markers: str) -> None:
    strat = strategy((1, 2))
    mgr = manager(root, strat)
    mgr.save(BasicTensorAwareStateDict(make_state(rank, K)), K)
    queue = AsyncCallsQueue(persistent=True)
    request = mgr.save(BasicTensorAwareStateDict(make_state(rank, K + 1)), K + 1, is_async=True)
    marker = os.path.join(markers, f"written-{rank}")
    stalled = functools.partial(write_then_stall, request.async_fn, marker)
    queue.schedule_async_request(request._replace(async_fn=stalled))
    _wait_for([os.path.join(markers, f"written-{r}") for r in range(world_size)], 90)
    if rank == VICTIM:
        os.kill(os.getpid(), signal.SIGKILL)
    queue.maybe_finalize_async_calls(blocking=True)  # fails or is killed by the launcher


def _restart(rank: int, world_size: int, root: str) -> list[str]:
    strat = strategy((1, 2))
    latest, loaded = load_fresh(root, strat)
    assert latest == K, f"rank {rank}: find_latest {latest} after the crash"
    assert_same(make_state(rank, K), loaded, f"rank {rank} after restart")
    barrier()
    after_restart = listing(root)

    mgr = manager(root, strat)
    assert mgr.find_latest() == K
    queue = AsyncCallsQueue(persistent=True)
    request = mgr.save(BasicTensorAwareStateDict(make_state(rank, K + 1)), K + 1, is_async=True)
    dying = functools.partial(write_then_die, request.async_fn, 1, rank)
    queue.schedule_async_request(request._replace(async_fn=dying))
    try:
        queue.maybe_finalize_async_calls(blocking=True)
        raise AssertionError("the worker death was not reported")
    except WorkerError as exc:
        assert 1 in exc.failed_ranks, exc.failed_ranks
    finally:
        queue.close(abort=True)
    latest, loaded = load_fresh(root, strat)
    assert latest == K
    assert_same(clone_state(make_state(rank, K)), loaded, f"rank {rank} after worker death")
    return after_restart


def test_sigkill_during_async_save_keeps_previous_iteration(tmp_path):
    root, markers = str(tmp_path / "ckpt"), str(tmp_path / "markers")
    os.makedirs(markers)
    with pytest.raises((RankFailure, RankTimeout)):
        launch(_first_run, 4, root, markers, timeout=120)
    dirty = [f for _, _, files in os.walk(root) for f in files if ".dirty." in f]
    assert dirty, "the killed save should have left dirty files behind"
    listings = launch(_restart, 4, root, timeout=150)
    for rank, names in enumerate(listings):
        assert names and all(n.startswith(f"iter_{K:07d}_") for n in names), (rank, names)
