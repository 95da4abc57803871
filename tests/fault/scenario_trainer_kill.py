"""Trainers SIGKILLed at random points of async saves; every restart checked.

Rows of the matrix: "trainer SIGKILLed at a random point of an async save (DCP and local)"
and "trainer SIGKILLed: its worker exits within 10 s, no shared-memory segment left".

Cheap trials: one supervisor process (spawned once, torch imported once, no process group)
*forks* a 2-rank gloo job per trial, so a trial costs a fork and a rendezvous, not two
interpreter start-ups. Each job first restarts: it finds the newest checkpoint of each kind
(async DCP; local with replication factor 2; local without replication), checks that it is
the one the previous job's kill allowed, and loads it bit-exact. Then it saves all three,
asynchronously on one queue, in a loop, training in between, until the supervisor SIGKILLs
each rank's trainer at its own random time (so one rank may die mid-commit while the other
is already in the next save). Every fourth job uses the persistent worker (it pays a worker
start-up), the others the fork-per-request caller.

What the restart must find, per kind: at least the newest iteration some rank reported
committed (a finalize function after the commit tells the supervisor), at most the newest
one whose save had started. Committed DCP checkpoints must all verify; local ones must
leave no interrupted-save file behind once ``find_latest`` ran.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import random
import signal
import statistics
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from resilient_ckpt.async_ckpt.core import AsyncCallsQueue
from resilient_ckpt.local import BasicTensorAwareStateDict
from resilient_ckpt.testing import launch
from resilient_ckpt.testing.faults import descendants, wait_gone
from tests._helpers import shm_segments

from . import _common as c

WORLD = 2
NBYTES = 256 << 10  # per rank and kind
KINDS = ("dcp", "local", "plain")
_SALT = {"dcp": 1, "local": 2, "plain": 3}
WORKER_EXIT_S = 10.0


def expected_state(kind: str, rank: int, iteration: int) -> dict[str, Any]:
    return c.tensor_state(rank, iteration, NBYTES, salt=_SALT[kind])


# -- the trainer (a forked child of the supervisor) ------------------------------------------


def _restore(rank: int, root: str) -> tuple[dict[str, int], list[str], dict[str, Any]]:
    problems: list[str] = []
    latest: dict[str, int] = {}
    dcp_root = os.path.join(root, "dcp")
    latest["dcp"], found = c.latest_dcp(dcp_root)
    problems += found
    if latest["dcp"] >= 0:
        bad = c.load_dcp(dcp_root, latest["dcp"], expected_state("dcp", rank, latest["dcp"]))
        if bad:
            problems.append(f"DCP iteration {latest['dcp']} on rank {rank}: {bad}")
    managers = {}
    for kind in ("local", "plain"):
        mgr = c.local_manager(os.path.join(root, kind), replicated=(kind == "local"))
        latest[kind], bad = c.restore_local(mgr, functools.partial(expected_state, kind, rank))
        if bad:
            problems.append(f"{kind} iteration {latest[kind]} on rank {rank}: {bad}")
        leftovers = c.dirty_leftovers(mgr)
        if leftovers:
            problems.append(f"{kind}: leftovers after find_latest on rank {rank}: {leftovers}")
        managers[kind] = mgr
    return latest, problems, managers


def _report(conn: Connection, kind: str, iteration: int) -> None:
    conn.send(("committed", kind, iteration))


def _save_loop(
    rank: int, root: str, queue: AsyncCallsQueue, managers: dict, first: int, conn: Connection
) -> None:
    cache = c.CheckpointMetadataCache()
    dcp_root = os.path.join(root, "dcp")
    deadline = time.monotonic() + 120
    for iteration in range(first, first + 100_000):
        if time.monotonic() > deadline:
            raise TimeoutError("the supervisor never killed this trainer")
        states = {kind: expected_state(kind, rank, iteration) for kind in KINDS}
        for kind in KINDS:  # before the save starts: it may commit before a kill
            conn.send(("scheduled", kind, iteration))
        report = functools.partial(_report, conn, "dcp", iteration)
        path = c.dcp_dir(dcp_root, iteration)
        queue.schedule_async_request(c.dcp_request(states["dcp"], path, cache, finalize=[report]))
        for kind in ("local", "plain"):
            request = managers[kind].save(
                BasicTensorAwareStateDict(states[kind]), iteration, is_async=True
            )
            request.add_finalize_fn(functools.partial(_report, conn, kind, iteration))
            queue.schedule_async_request(request)
        for state in states.values():
            c.mutate(state)
        queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
        if rank == 0 and iteration - 2 >= first:
            c.drop_dcp(dcp_root, iteration - 2)


def _trainer(
    rank: int, store: str, root: str, mode: str, first: int, restart_only: bool, conn: Connection
) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=WORLD,
            timeout=timedelta(seconds=60),
        )
        if mode == "persistent" and not restart_only:
            AsyncCallsQueue.warmup_persistent_caller(rank)
        started = time.monotonic()
        latest, problems, managers = _restore(rank, root)
        conn.send(("restored", rank, latest, problems, time.monotonic() - started))
        if restart_only:
            dist.destroy_process_group()
            return
        queue = c.new_queue(mode)
        c.wait_ready(queue)
        conn.send(("ready", rank))
        _save_loop(rank, root, queue, managers, first, conn)
    except BaseException as exc:
        # Quietly: after a peer was killed this is the expected reaction, not news.
        conn.send(("failed", rank, "".join(traceback.format_exception(exc))))
        conn.close()
        os._exit(1)


# -- the supervisor ---------------------------------------------------------------------------


class _Job:
    """One forked 2-rank job and the messages it sent."""

    def __init__(self, root: str, index: int, mode: str, first: int, restart_only: bool):
        store = os.path.join(root, "stores", f"job{index}")
        os.makedirs(os.path.dirname(store), exist_ok=True)
        ctx = mp.get_context("fork")
        self.procs, self.conns = [], []
        for rank in range(WORLD):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_trainer, args=(rank, store, root, mode, first, restart_only, writer)
            )
            proc.start()
            writer.close()
            self.procs.append(proc)
            self.conns.append(reader)
        self.messages: list[tuple[float, tuple]] = []
        self.restored: dict[int, tuple] = {}
        self.ready: set[int] = set()
        self.error: str | None = None

    def pump(self, until: float) -> None:
        """Receive messages until ``until`` (monotonic) or until every pipe is closed."""
        while self.conns:
            ready = wait(self.conns, max(0.0, until - time.monotonic()))
            if not ready:
                return
            for conn in ready:
                assert isinstance(conn, Connection)
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    self.conns.remove(conn)
                    continue
                self._note(message)

    def _note(self, message: tuple) -> None:
        self.messages.append((time.monotonic(), message))
        if message[0] == "restored":
            self.restored[message[1]] = message
        elif message[0] == "ready":
            self.ready.add(message[1])
        elif message[0] == "failed" and self.error is None:
            self.error = f"rank {message[1]}: {message[2]}"

    def wait_for(self, condition: Any, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not condition() and self.error is None and time.monotonic() < deadline:
            self.pump(min(deadline, time.monotonic() + 0.05))
        return bool(condition())

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.exitcode is None:
                os.kill(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            proc.join(10)


def _judge(job: _Job, bounds: dict[str, list[int]]) -> c.Trial:
    """Whether the restart found what the previous job's kill allowed, bit-exact."""
    problems = []
    seconds = max(m[4] for m in job.restored.values())
    for rank, (_, _, latest, found, _) in sorted(job.restored.items()):
        problems += found
        for kind in KINDS:
            committed, attempted = bounds[kind]
            if not committed <= latest[kind] <= max(committed, attempted):
                problems.append(
                    f"rank {rank} {kind}: restart found {latest[kind]}, expected between "
                    f"{committed} (committed) and {attempted} (started)"
                )
    return c.Trial(not problems, False, seconds, "; ".join(problems))


def _kill_at(job: _Job, delays: list[float]) -> tuple[list[int], float, str | None]:
    """SIGKILL each rank's trainer at its delay; its descendants must exit within 10 s.

    Returns the survivors, the seconds until the last was gone, and an error a trainer
    reported before the first kill (later ones are the peers' reaction to the kill)."""
    start = time.monotonic()
    children: list[int] = []
    error = None
    for order, rank in enumerate(sorted(range(WORLD), key=lambda r: delays[r])):
        job.pump(start + delays[rank])
        if order == 0:
            error = job.error
        proc = job.procs[rank]
        children += descendants(proc.pid)
        if proc.exitcode is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
    survivors, waited = wait_gone(children, WORKER_EXIT_S)
    job.pump(time.monotonic() + 1.0)  # what the dead trainers sent before dying
    return survivors, waited, error


def _update(bounds: dict[str, list[int]], job: _Job) -> list[float]:
    """Fold the job's reports into the bounds; returns the times saves started."""
    starts: dict[int, float] = {}
    for stamp, message in job.messages:
        if message[0] == "scheduled":
            bounds[message[1]][1] = max(bounds[message[1]][1], message[2])
            starts.setdefault(message[2], stamp)
        elif message[0] == "committed":
            bounds[message[1]][0] = max(bounds[message[1]][0], message[2])
    return [starts[k] for k in sorted(starts)]


def _shm() -> set[str]:
    return shm_segments()


def _supervise(_: int, __: int, root: str, trials: int, seed: int) -> dict[str, list[c.Trial]]:
    rng = random.Random(seed)
    bounds = {kind: [-1, -1] for kind in KINDS}  # [committed, started]
    span = 1.0
    kills: list[c.Trial] = []
    orphans: list[c.Trial] = []
    for index in range(trials + 1):
        last = index == trials
        mode = "persistent" if index % 4 == 0 else "fork"
        first = max(b[1] for b in bounds.values()) + 1
        shm_before = _shm()
        t0 = time.monotonic()
        job = _Job(root, index, mode, first, restart_only=last)
        try:
            if not job.wait_for(lambda job=job: len(job.restored) == WORLD, 90):
                if job.error is not None:
                    kills.append(c.failed(f"restart failed: {job.error}"))
                else:
                    kills.append(c.hung("the restart did not finish within 90 s"))
                continue
            t1 = time.monotonic()
            if index > 0:
                kills.append(_judge(job, bounds))
            if last:
                job.wait_for(lambda job=job: not job.conns, 30)
                continue
            if not job.wait_for(lambda job=job: len(job.ready) == WORLD, 90):
                orphans.append(c.failed(job.error or "the job did not become ready in 90 s"))
                continue
            t2 = time.monotonic()
            delays = [rng.uniform(0.0, span) for _ in range(WORLD)]
            survivors, waited, error = _kill_at(job, delays)
            t3 = time.monotonic()
            leaked = _shm() - shm_before
            detail = f"{mode}: survivors {survivors}, new /dev/shm entries {sorted(leaked)}"
            orphans.append(
                c.Trial(
                    not survivors and not leaked,
                    False,
                    waited,
                    "" if not survivors and not leaked else detail,
                )
            )
            starts = _update(bounds, job)
            if os.environ.get("CHAOS_DEBUG"):
                print(
                    f"job {index} {mode}: span {span:.2f} delays {delays} bounds {bounds} "
                    f"children checked {len(job.procs)} survivors {survivors} "
                    f"restore {t1 - t0:.2f} ready {t2 - t1:.2f} kill {t3 - t2:.2f}",
                    flush=True,
                )
            if len(starts) >= 3:
                span = max(
                    0.3,
                    2.5
                    * statistics.median(b - a for a, b in zip(starts, starts[1:], strict=False)),
                )
            if error is not None:
                kills.append(c.failed(f"a trainer failed before any kill: {error}"))
        finally:
            job.kill_all()
    return {"trainer_kill": kills, "trainer_kill_orphans": orphans}


def run(workdir: str, trials: int, seed: int = 0) -> dict[str, list[c.Trial]]:
    """``trials`` kills (plus one last restart to check the last one)."""
    return launch(
        _supervise, 1, workdir, trials, seed, timeout=120 + 30 * trials, process_group=False
    )[0]
