"""A durable-tier write that fails on one rank only (its durable path is not a directory):
every rank gets the error at ``maybe_finalize``, naming the rank, without waiting for a
deadline; that step is not committed to the durable tier; the next saves go on, and a
restore returns the newest committed step, exact."""

from __future__ import annotations

import os
import tempfile
import time

import pytest
import torch

from resilient_ckpt.errors import CheckpointingException
from resilient_ckpt.testing import launch
from resilient_ckpt.tiered import TieredCheckpointManager

pytestmark = [pytest.mark.dist]


def _job(rank: int, world: int, root: str) -> dict:
    durable = os.path.join(root, "durable")
    if rank == 1:
        blocker = os.path.join(root, "not-a-dir")
        open(blocker, "w").close()
        durable = os.path.join(blocker, "durable")  # every mkdir under it fails: ENOTDIR
    mgr = TieredCheckpointManager(
        os.path.join(root, "mem"),
        durable,
        replication_factor=2,
        replication_jump=1,
        durable_every=2,
    )
    key = f"rank{rank}.w"  # one key per rank: DCP saves a shared plain key once
    state = {key: torch.full((64,), float(rank))}
    outcome: dict = {}
    for step in (1, 2, 3):
        state[key].fill_(rank * 100 + step)
        started = time.monotonic()
        try:
            mgr.save(state, step)
            mgr.maybe_finalize(blocking=True)
            outcome[step] = "ok"
        except CheckpointingException as exc:
            outcome[step] = str(exc)
        outcome[f"seconds{step}"] = time.monotonic() - started
    mgr.close()
    fresh = TieredCheckpointManager(
        os.path.join(root, "mem"), durable, replication_factor=2, replication_jump=1
    )
    into = {key: torch.zeros(64)}
    outcome["restored"] = fresh.load(into)
    outcome["exact"] = torch.equal(into[key], torch.full((64,), float(rank * 100 + 3)))
    fresh.close()
    return outcome


@pytest.mark.timeout(180)
def test_durable_failure_on_one_rank_is_an_error_on_every_rank() -> None:
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        # A finalize deadline far above the bound below: waiting for it cannot pass for
        # a slow machine's real work.
        results = launch(_job, 2, d, timeout=150, env={"RESILIENT_CKPT_FINALIZE_TIMEOUT": "400"})
        durable = sorted(os.listdir(os.path.join(d, "durable")))
        committed = [
            s for s in durable if os.path.exists(os.path.join(d, "durable", s, ".metadata"))
        ]
    for outcome in results:
        assert outcome[1] == "ok" and outcome[3] == "ok", outcome
        assert "durable" in outcome[2] and "rank(s) [1]" in outcome[2], outcome[2]
        assert outcome["seconds2"] < 100, "the error must not wait for a deadline"
        assert outcome["restored"] == 3 and outcome["exact"]
    assert committed == [], committed  # step 2 was the only durable save, and it failed
