"""Storage that fails, fills up or is slow, on one rank: named errors everywhere, no loss.

Rows of the matrix, all in one 2-rank job (one launch, one worker start-up):

* ``write_raises``: one rank's storage raises ``EIO`` at a phase of the save, cycling
  through every phase there is: for DCP the writer's set-up (``makedirs``, trainer), the
  data file's open, a random byte of it, its rename (worker) and the commit record
  (trainer); for local saves before or after the copies
  are written, in the worker, in the replication thread, or inline for a synchronous save.
* ``disk_full``: a real full file system. The test mounts a small ``tmpfs``; the job fills
  it so that a random amount short of the next save is free, saves, and must get a named
  error; the previous checkpoint must verify and load bit-exact; once the filler is
  removed the next save must succeed (a failed save must not keep its space).
* ``disk_full_injected``: ``ENOSPC`` raised by the storage wrapper at a random byte of a
  DCP data file (runs where mounting is not allowed too).
* ``slow_rank``: one rank's writes are delayed far past the finalize deadline; every rank
  must wait that deadline, then raise ``CheckpointTimeoutError`` naming the slow rank.

After every failure the trial checks, on every rank, that nothing was committed and that
the previous checkpoint still loads bit-exact; the next trial saves again on the same
queue (or on a fresh one, after a timeout).
"""

from __future__ import annotations

import errno
import os
import random
import re
import time
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

from resilient_ckpt.config import Timeouts
from resilient_ckpt.errors import CheckpointingException, CheckpointTimeoutError
from resilient_ckpt.testing.faults import (
    Action,
    Fault,
    Phase,
    descendants,
    fill_filesystem,
    free_bytes,
    wait_gone,
)

from . import _common as c

WORLD = 2
NBYTES = 512 << 10
VICTIM = 1
SLOW_DEADLINE_S = 3.0
ERROR_WITHIN_S = 30.0  # a failed write must be reported at once, not at a deadline

# (kind, fault phase, file pattern, how the save runs); the victim is rank 1 except for
# the commit record, which only the coordinator (rank 0) writes.
WRITE_CASES: list[tuple[str, Phase, str, str]] = [
    ("dcp", Phase.OPEN_WRITE, "*.distcp", "async"),
    ("dcp", Phase.WRITE, "*.distcp", "async"),
    ("dcp", Phase.BEFORE_COMMIT, "*.distcp", "async"),
    ("dcp", Phase.OPEN_WRITE, ".metadata", "async"),
    ("dcp", Phase.MAKEDIRS, "*", "async"),
    ("plain", Phase.BEFORE_CALL, "*", "async"),
    ("plain", Phase.AFTER_CALL, "*", "async"),
    ("repl", Phase.BEFORE_CALL, "*", "thread"),
    ("repl", Phase.AFTER_CALL, "*", "thread"),
    ("plain", Phase.BEFORE_CALL, "*", "sync"),
    ("dcp", Phase.WRITE, "*.distcp", "sync"),
]


def _named(exc: BaseException, victim: int) -> str | None:
    """None if ``exc`` is a named checkpoint error that names ``victim``."""
    if isinstance(exc, CheckpointException):
        if victim in exc.failures:
            return None
        return f"CheckpointException names ranks {sorted(exc.failures)}, not {victim}"
    if isinstance(exc, CheckpointingException):
        ranks = getattr(exc, "failed_ranks", None)
        if ranks is not None and victim in ranks or f"rank {victim}" in str(exc):
            return None
        return f"{type(exc).__name__} does not name rank {victim}: {exc}"
    return f"not a named checkpoint error: {type(exc).__name__}: {exc}"


def _run_save(
    job: _Job, kind: str, iteration: int, how: str, faults: list[Fault], queue: Any = None
) -> BaseException | None:
    """Run one save; the exception it raised (None if it succeeded)."""
    try:
        if how == "sync":
            job.saves.save_sync(kind, iteration, faults)
            return None
        background = faults if how == "async" else []
        in_thread = faults if how == "thread" else []
        request = job.saves.request(kind, iteration, background, write_faults=in_thread)
        (queue or job.queue).schedule_async_request(request)
        (queue or job.queue).maybe_finalize_async_calls(blocking=True, no_dist=False)
    except BaseException as exc:  # torch's CheckpointException is a BaseException
        return exc
    return None


class _Job:
    def __init__(self, rank: int, root: str, seed: int) -> None:
        self.rank = rank
        self.root = root
        self.seed = seed
        self.saves = c.Saves(rank, root, NBYTES)
        self.queue = c.new_queue("persistent")
        self.iteration = 0

    def next_iteration(self) -> int:
        self.iteration += 1
        return self.iteration

    def baseline(self) -> None:
        for kind in c.KINDS:
            iteration = self.next_iteration()
            self.saves.save_sync(kind, iteration)
            self.saves.committed[kind] = iteration

    def expect_failure(
        self, kind: str, iteration: int, error: BaseException | None, victim: int, seconds: float
    ) -> c.Trial:
        """Every rank failed with a named error; nothing committed; previous intact."""
        problem = "the save succeeded" if error is None else _named(error, victim)
        if seconds > ERROR_WITHIN_S:
            problem = f"the error took {seconds:.1f}s; {problem or ''}"
        dist.barrier()
        problem = problem or self.saves.check_previous(kind, iteration)
        return c.failed(f"{kind}: {problem}", seconds) if problem else c.Trial(True, False, seconds)


def _write_raises(job: _Job, t: int) -> c.Trial:
    kind, phase, pattern, how = WRITE_CASES[t % len(WRITE_CASES)]
    rng = random.Random(job.seed * 31 + t)
    victim = 0 if pattern == ".metadata" else VICTIM
    fault = Fault(
        phase, Action.RAISE, ranks=(victim,), match=pattern, after_bytes=rng.randrange(NBYTES // 4)
    )
    iteration = job.next_iteration()
    started = time.monotonic()
    error = _run_save(job, kind, iteration, how, [fault])
    trial = job.expect_failure(kind, iteration, error, victim, time.monotonic() - started)
    trial.detail = f"{phase.value} {pattern} ({how}): {trial.detail}" if trial.detail else ""
    return trial


def _disk_full(job: _Job, t: int, mount: str) -> c.Trial:
    """Fill the tmpfs to a random point short of the next save; then free it again."""
    kind = c.KINDS[t % len(c.KINDS)]
    rng = random.Random(job.seed * 37 + t)
    needed = WORLD * (2 if kind == "repl" else 1) * NBYTES
    filler = ""
    if job.rank == 0:
        filler = fill_filesystem(mount, leave_free=int(rng.uniform(0.0, 0.8) * needed))
    dist.barrier()
    free = free_bytes(mount)
    iteration = job.next_iteration()
    started = time.monotonic()
    error = _run_save(job, kind, iteration, "async", [])
    seconds = time.monotonic() - started
    if error is None:
        problem: str | None = "the save succeeded"
    elif not isinstance(error, (CheckpointingException, CheckpointException)):
        problem = f"not a named error: {type(error).__name__}: {error}"
    elif seconds > ERROR_WITHIN_S:
        problem = f"the error took {seconds:.1f}s: {error!r}"
    else:
        problem = None
    dist.barrier()
    problem = problem or job.saves.check_previous(kind, iteration)
    if job.rank == 0:
        os.unlink(filler)
    dist.barrier()
    recovered = job.next_iteration()
    error = _run_save(job, kind, recovered, "async", [])
    if error is not None:
        problem = f"{problem or ''}; the save after freeing the space failed: {error!r}"
    else:
        problem = job.saves.check_committed(kind, recovered) or problem
    if problem:
        return c.failed(f"{kind}, {free} bytes free of {needed} needed: {problem}", seconds)
    return c.Trial(True, False, seconds)


def _disk_full_injected(job: _Job, t: int) -> c.Trial:
    rng = random.Random(job.seed * 41 + t)
    fault = Fault(
        Phase.WRITE,
        Action.RAISE,
        ranks=(VICTIM,),
        match="*.distcp",
        after_bytes=rng.randrange(NBYTES // 4),
        errno=errno.ENOSPC,
    )
    iteration = job.next_iteration()
    started = time.monotonic()
    error = _run_save(job, "dcp", iteration, "async", [fault])
    trial = job.expect_failure("dcp", iteration, error, VICTIM, time.monotonic() - started)
    if trial.passed and "No space left on device" not in "".join(
        str(f) for f in getattr(error, "failures", {}).values()
    ):
        return c.failed(f"the ENOSPC cause is not reported: {error}")
    return trial


def _slow_rank(job: _Job, t: int) -> c.Trial:
    """Rank 1's writes hang; every rank waits the finalize deadline, then raises."""
    kind = ("dcp", "plain")[t % 2]
    mode = ("persistent", "fork")[t % 2]
    timeouts = Timeouts(finalize=SLOW_DEADLINE_S, collective=60, shutdown=10)
    before = set(descendants())  # the main queue's worker is none of this trial's business
    queue = c.new_queue(mode, timeouts=timeouts)
    if kind == "dcp":
        fault = Fault(Phase.WRITE, Action.DELAY, ranks=(VICTIM,), match="*.distcp", seconds=3600)
    else:
        fault = Fault(Phase.BEFORE_CALL, Action.DELAY, ranks=(VICTIM,), seconds=3600)
    iteration = job.next_iteration()
    c.wait_ready(queue)
    started = time.monotonic()
    error = _run_save(job, kind, iteration, "async", [fault], queue=queue)
    seconds = time.monotonic() - started
    problem = None
    # The victim must be named; on a loaded machine another rank's write may also still
    # run at the deadline and be named beside it.
    named = re.search(r"rank\(s\) \[([\d, ]*)\]", str(error))
    if (
        not isinstance(error, CheckpointTimeoutError)
        or named is None
        or str(VICTIM) not in named.group(1).split(", ")
    ):
        problem = f"expected a CheckpointTimeoutError naming rank {VICTIM}, got {error!r}"
    elif not SLOW_DEADLINE_S * 0.5 <= seconds <= SLOW_DEADLINE_S + 15:
        problem = f"raised after {seconds:.1f}s, the deadline is {SLOW_DEADLINE_S}s"
    queue.close(abort=True)
    survivors, _ = wait_gone(set(descendants()) - before, 10)
    if survivors:
        problem = f"{problem or ''} background processes left after close(abort=True): {survivors}"
    dist.barrier()
    problem = problem or job.saves.check_previous(kind, iteration)
    return (
        c.failed(f"{kind}/{mode}: {problem}", seconds) if problem else c.Trial(True, False, seconds)
    )


def _job(
    rank: int, world: int, root: str, mount: str | None, counts: dict[str, int], seed: int
) -> dict[str, list[c.Trial]]:
    job = _Job(rank, root, seed)
    job.baseline()
    c.wait_ready(job.queue)
    out: dict[str, list[c.Trial]] = {name: [] for name in counts}
    for t in range(counts.get("write_raises", 0)):
        out["write_raises"].append(_write_raises(job, t))
    for t in range(counts.get("disk_full_injected", 0)):
        out["disk_full_injected"].append(_disk_full_injected(job, t))
    if mount is not None and counts.get("disk_full"):
        full = _Job(rank, mount, seed)
        full.queue = job.queue
        full.baseline()
        for t in range(counts["disk_full"]):
            out["disk_full"].append(_disk_full(full, t, mount))
    for t in range(counts.get("slow_rank", 0)):
        out["slow_rank"].append(_slow_rank(job, t))
    job.queue.close()
    return out


def run(
    workdir: str, counts: dict[str, int], seed: int = 0, mount: str | None = None
) -> dict[str, list[c.Trial]]:
    """``counts``: trials per row; ``mount``: a small tmpfs for ``disk_full`` (or None)."""
    total = sum(counts.values())
    return c.launch_rows(
        _job, WORLD, workdir, mount, counts, seed, counts=counts, timeout=120 + 20 * total
    )
