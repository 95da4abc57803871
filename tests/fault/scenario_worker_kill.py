"""The background worker SIGKILLed mid-write: every rank raises within 30 s, nothing commits.

Row of the matrix: "worker SIGKILLed mid-write". One 2-rank job runs every trial. A trial
picks (identically on both ranks) a kind of save, a caller (the persistent worker or the
fork-per-request child) and a victim rank, and kills the victim's background process at a
random point of its write: for DCP at a random byte offset of a data file (a ``Fault`` of
phase ``WRITE``), for local saves at a random time while the background call runs (phase
``DURING_CALL``; for a replicated save the worker is then waiting for the replication
thread). Every rank must raise ``WorkerDiedError`` naming the victim within 30 s, the
checkpoint must not be committed, and the previous one must still load bit-exact. The next
trial uses the same queue: the persistent worker is restarted on demand.
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch.distributed as dist

from resilient_ckpt.errors import WorkerDiedError
from resilient_ckpt.testing.faults import Action, Fault, Phase

from . import _common as c

WORLD = 2
NBYTES = 1 << 20
DEADLINE_S = 30.0
KINDS = c.KINDS


def _trial(saves: c.Saves, queues: dict, t: int, seed: int) -> c.Trial:
    rng = random.Random(seed * 7919 + t)
    kind = KINDS[t % len(KINDS)]
    mode = "persistent" if (t // len(KINDS)) % 2 == 0 else "fork"
    victim = rng.randrange(WORLD)
    iteration = 100 + t
    if kind == "dcp":
        fault = Fault(
            Phase.WRITE,
            Action.KILL,
            ranks=(victim,),
            match="*.distcp",
            after_bytes=rng.randrange(NBYTES // 2),
        )
    else:
        fault = Fault(
            Phase.DURING_CALL,
            Action.KILL,
            ranks=(victim,),
            seconds=0.3,
            seed=rng.randrange(1 << 30),
        )
    queue = queues[mode]
    queue.schedule_async_request(saves.request(kind, iteration, [fault]))
    started = time.monotonic()
    outcome = _expect_death(queue, victim, f"{kind}/{mode}")
    seconds = time.monotonic() - started
    dist.barrier()
    problem = outcome or saves.check_previous(kind, iteration)
    if seconds > DEADLINE_S:
        problem = f"{kind}/{mode}: raised after {seconds:.1f}s; {problem or ''}"
    return c.failed(problem, seconds) if problem else c.Trial(True, False, seconds)


def _expect_death(queue: Any, victim: int, what: str) -> str | None:
    """None if finalizing raises WorkerDiedError naming ``victim``, else what went wrong."""
    try:
        queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    except WorkerDiedError as exc:
        if victim not in exc.failed_ranks or f"rank {victim}" not in str(exc):
            return f"{what}: the error does not name rank {victim}: {exc}"
        return None
    except BaseException as exc:
        return c.from_exception(f"{what}: wrong error", exc).detail
    return f"{what}: the killed worker of rank {victim} was not reported"


def _job(rank: int, world: int, root: str, trials: int, seed: int) -> list[c.Trial]:
    saves = c.Saves(rank, root, NBYTES)
    queues = {"persistent": c.new_queue("persistent"), "fork": c.new_queue("fork")}
    for kind in KINDS:  # the committed checkpoints every trial must leave intact
        queues["fork"].schedule_async_request(saves.request(kind, 0, []))
        queues["fork"].maybe_finalize_async_calls(blocking=True, no_dist=False)
        saves.committed[kind] = 0
    results = []
    for t in range(trials):
        results.append(_trial(saves, queues, t, seed))
    for queue in queues.values():
        queue.close(abort=True)
    return results


def run(workdir: str, trials: int, seed: int = 0) -> dict[str, list[c.Trial]]:
    return {
        "worker_kill": c.launch_trials(
            _job, WORLD, workdir, trials, seed, trials=trials, timeout=90 + 45 * trials
        )
    }
