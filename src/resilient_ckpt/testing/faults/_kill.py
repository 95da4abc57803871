"""SIGKILL a trainer or its background worker at a chosen or random point of a save.

A killed process gets no chance to clean up, which is the point: what is on storage
afterwards is whatever the save had reached. :func:`kill_after` does it from a daemon
thread (of the trainer itself, or of a supervising process), :func:`kill_during_save` picks
the moment at random within a window right after a save was scheduled, and
:func:`wait_gone` checks that the processes that must die with a trainer did. For a kill at
an exact point of the write (a byte offset, before the commit) use a :class:`~._plan.Fault`
with ``Action.KILL`` / ``Action.KILL_PARENT`` instead.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from ...errors import ConfigurationError

Target = int | Callable[[], int | None]


class KillTimer:
    """SIGKILLs a process ``delay`` seconds after it was made, unless cancelled first.

    ``target`` is a pid, or a function returning one when the timer fires (None: nothing
    to kill then). ``fired_at`` is the ``time.monotonic()`` of the kill, ``killed`` the pid.
    """

    def __init__(self, target: Target, delay: float) -> None:
        if delay < 0:
            raise ConfigurationError(f"delay must be >= 0, got {delay}")
        self.delay = delay
        self.killed: int | None = None
        self.fired_at: float | None = None
        self._target = target
        self._cancel = threading.Event()
        self._thread = threading.Thread(target=self._run, name="resilient_ckpt-killer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._cancel.wait(self.delay):
            return
        pid = self._target() if callable(self._target) else self._target
        if pid is None:
            return
        self.fired_at = time.monotonic()
        self.killed = pid
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            self.killed = None

    def cancel(self) -> None:
        self._cancel.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def fired(self) -> bool:
        return self.fired_at is not None


def kill_after(target: Target, delay: float) -> KillTimer:
    """SIGKILL ``target`` (a pid or a function returning one) in ``delay`` seconds."""
    return KillTimer(target, delay)


def worker_pids(queue: Any) -> list[int]:
    """Pids of the live background processes of an ``AsyncCallsQueue`` (its persistent
    worker; the forked children of requests in flight)."""
    pids = []
    caller = getattr(queue, "persistent_caller", None)
    process = getattr(caller, "process", None)
    if process is not None and process.exitcode is None:
        pids.append(int(process.pid))
    for active in getattr(queue, "async_calls", ()):
        child = getattr(active.async_caller, "process", None)
        if child is not None and child.exitcode is None and int(child.pid) not in pids:
            pids.append(int(child.pid))
    return pids


def kill_during_save(
    queue: Any,
    *,
    target: str = "worker",
    within: float = 1.0,
    rng: random.Random | None = None,
) -> KillTimer:
    """Call right after ``schedule_async_request``: SIGKILL this trainer (``"trainer"``) or
    its background worker (``"worker"``) at a uniformly random time within ``within``
    seconds. If the save ends first, the kill still comes (a trainer then dies between
    saves, a worker while idle: both are points a real crash can hit)."""
    if target not in ("trainer", "worker"):
        raise ConfigurationError(f"target must be 'trainer' or 'worker', got {target!r}")
    delay = (rng or random.Random()).uniform(0.0, within)
    if target == "trainer":
        return kill_after(os.getpid(), delay)

    def first_worker() -> int | None:
        pids = worker_pids(queue)
        return pids[0] if pids else None

    return kill_after(first_worker, delay)


def descendants(pid: int | None = None) -> list[int]:
    """Pids of every process below ``pid`` (default: this process)."""
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid or os.getpid()).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def is_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids: Iterable[int], timeout: float) -> tuple[list[int], float]:
    """Wait up to ``timeout`` seconds for ``pids`` to exit; returns the survivors and the
    seconds waited."""
    started = time.monotonic()
    alive = list(pids)
    while True:
        alive = [pid for pid in alive if is_alive(pid)]
        waited = time.monotonic() - started
        if not alive or waited >= timeout:
            return alive, waited
        time.sleep(0.02)
