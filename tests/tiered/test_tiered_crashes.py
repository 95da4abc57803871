"""Never hangs, never lies: crashes at 4 ranks, each followed by a restart that resumes.

Each trial is one launch: it resumes (the restored state must equal the deterministic
reference for that step, bit for bit), makes two saves it waits for, then crashes:

* ``trainer``: one random rank's trainer is SIGKILLed at a random time during the next saves
  (non-blocking saves, so the kill lands anywhere: staging, writes, replication, commit);
* ``phase``: one rank's trainer is SIGKILLed at a chosen phase of a save through the fault
  kit's :func:`kill_at_tiered_phase` (after the snapshot, the memory write, the replicas);
* ``worker``: one rank's background worker is killed mid-write of its memory-tier file
  (``Action.KILL`` at a byte offset): every rank gets the error, reloads, and continues.

The launch after a trainer crash must resume from at least the last step that was waited
for, bit-exact; the last trial (a worker kill, or a plain resume) also checks that training
continues bit-exact. ``--long`` runs a soak of 12 trials of all kinds.
"""

from __future__ import annotations

import pytest

from resilient_ckpt.testing import RankFailure, RankTimeout, launch

from . import _jobs

pytestmark = [pytest.mark.dist, pytest.mark.fault]


def _trial(root: str, seed: int, kind: str) -> list[dict] | None:
    try:
        return launch(_jobs.crash_trial, 4, root, seed, kind, timeout=180)
    except (RankFailure, RankTimeout) as exc:
        if kind == "worker":
            raise
        assert (
            "SIGKILL" in str(exc) or "exit" in str(exc).lower() or isinstance(exc, RankFailure)
        ), exc
        return None


def _check_resumed(facts: list[dict], at_least: int) -> None:
    for f in facts:
        assert f["exact"], f
        assert f["resumed"] is not None and f["resumed"] >= at_least, (f, at_least)
    assert len({f["resumed"] for f in facts}) == 1  # every rank agrees on the step


def _run(root: str, kinds: list[tuple[int, str]]) -> None:
    last_finalized = 0
    for seed, kind in kinds:
        facts = _trial(root, seed, kind)
        if facts is None:
            # the trial crashed after finalizing two saves beyond where it resumed
            last_finalized += 2
            continue
        _check_resumed(facts, last_finalized)
        last_finalized = facts[0]["finalized"]
        if kind == "worker":
            errors = {f["error"] for f in facts}
            assert len(errors) == 1 and None not in errors, errors  # the error on every rank
            for f in facts:
                assert f["reloaded"] >= f["finalized"] and f["reloaded_exact"], f
                assert f["continued_exact"], f
            last_finalized = facts[0]["reloaded"] + 2
    if kinds[-1][1] != "worker":  # a worker trial resumes and continues without a crash
        final = launch(_jobs.crash_trial, 4, root, 0, "resume", timeout=180)
        _check_resumed(final, last_finalized)
        assert all(f["continued_exact"] for f in final)


@pytest.mark.timeout(600)
def test_crashes_resume_bit_exact(tmp_path, request):
    kinds = [(1, "trainer"), (3, "phase"), (2, "worker")]
    if request.config.getoption("--long"):
        kinds = [(seed, ("trainer", "phase", "worker")[seed % 3]) for seed in range(1, 13)]
    _run(str(tmp_path), kinds)
