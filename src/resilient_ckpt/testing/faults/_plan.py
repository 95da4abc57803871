"""What to inject, where and on which ranks: :class:`Fault` values and the :class:`Injector`.

A fault is a frozen, picklable value, so it travels with a request into the background
worker (spawned or forked) and fires there, in the process that does the I/O. Phases are of
two kinds: storage phases fire inside a storage backend operation (see
:class:`~._storage.FaultyBackend`), call phases around a background call (see
:func:`~._storage.faulty_call`). A fault fires at most ``times`` times per
:class:`Injector`, and one injector is made per installation (one request, one ``with``
block), so "fail the first data file" means the first one of each save.
"""

from __future__ import annotations

import enum
import errno as errno_codes
import fnmatch
import os
import random
import signal
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ... import _dist
from ...errors import ConfigurationError


class Phase(str, enum.Enum):
    """Where a fault fires."""

    MAKEDIRS = "makedirs"  # a directory is created (a DCP writer's set-up, in the trainer)
    OPEN_WRITE = "open_write"  # an artifact's write begins (nothing written yet)
    WRITE = "write"  # when the byte at offset ``after_bytes`` of an artifact is written
    BEFORE_COMMIT = "before_commit"  # every byte written, before the artifact is made visible
    OPEN_READ = "open_read"  # an artifact is opened for reading
    DELETE = "delete"  # an artifact or directory is deleted
    BEFORE_CALL = "before_call"  # a background call (async_fn) starts
    DURING_CALL = "during_call"  # at a random time within ``seconds`` of the call's start
    AFTER_CALL = "after_call"  # the call returned, before its outcome is reported


STORAGE_PHASES = frozenset(
    {
        Phase.MAKEDIRS,
        Phase.OPEN_WRITE,
        Phase.WRITE,
        Phase.BEFORE_COMMIT,
        Phase.OPEN_READ,
        Phase.DELETE,
    }
)


class Action(str, enum.Enum):
    """What a fault does when it fires."""

    RAISE = "raise"  # raise OSError(errno, ...) (ENOSPC for a full disk, EIO by default)
    DELAY = "delay"  # sleep ``seconds``, then carry on (a slow disk or a slow rank)
    CORRUPT = "corrupt"  # WRITE only: flip the byte at ``after_bytes`` on its way to storage
    KILL = "kill"  # SIGKILL this process (in the background worker: the worker)
    KILL_PARENT = "kill_parent"  # SIGKILL the parent (from the worker: the trainer)


@dataclass(frozen=True)
class Fault:
    """One fault: ``action`` at ``phase``, on ``ranks`` (None: all), for matching paths.

    Args:
        phase, action: see :class:`Phase` and :class:`Action`.
        ranks: ranks on which it fires; None for every rank.
        match: ``fnmatch`` pattern on the artifact's base name (``"*.distcp"`` for DCP data
            files, ``".metadata"`` for the commit record); ignored by call phases.
        after_bytes: byte offset for ``Phase.WRITE``.
        seconds: sleep of ``Action.DELAY``; for ``Phase.DURING_CALL`` the window in which
            the fault fires, at a uniformly random time (the call does not return first).
        errno: error number of ``Action.RAISE``.
        times: how many times it fires per installation (None: every time).
        seed: seeds the random time of ``Phase.DURING_CALL`` (None: unpredictable).
    """

    phase: Phase
    action: Action
    ranks: tuple[int, ...] | None = None
    match: str = "*"
    after_bytes: int = 0
    seconds: float = 0.0
    errno: int = errno_codes.EIO
    times: int | None = 1
    seed: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "phase", Phase(self.phase))
        object.__setattr__(self, "action", Action(self.action))
        if self.ranks is not None:
            object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        if self.action == Action.CORRUPT and self.phase != Phase.WRITE:
            raise ConfigurationError("Action.CORRUPT needs Phase.WRITE (it flips a written byte)")
        if self.after_bytes < 0 or self.seconds < 0:
            raise ConfigurationError(
                f"after_bytes and seconds must be >= 0, got {self.after_bytes}, {self.seconds}"
            )
        if self.times is not None and self.times < 1:
            raise ConfigurationError(f"times must be >= 1 or None, got {self.times}")
        if self.phase == Phase.DURING_CALL and self.action not in (Action.KILL, Action.KILL_PARENT):
            raise ConfigurationError(
                "Phase.DURING_CALL supports Action.KILL and Action.KILL_PARENT (a timer thread "
                "cannot raise into the call)"
            )

    def applies(self, rank: int, phase: Phase, path: str | None = None) -> bool:
        if self.phase != phase or (self.ranks is not None and rank not in self.ranks):
            return False
        return path is None or fnmatch.fnmatch(os.path.basename(path.rstrip("/")), self.match)


class InjectedFault(OSError):
    """The error :attr:`Action.RAISE` raises (an ``OSError``, as real I/O failures are)."""


def current_rank() -> int:
    """This process's rank: the default process group's, else ``$RANK`` (inherited by the
    background worker, which has no process group), else 0."""
    if _dist.has_process_group():
        return _dist.rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class Injector:
    """The faults of one installation on one rank; counts how often each fired."""

    def __init__(
        self, faults: Iterable[Fault], rank: int | None = None, trainer: int | None = None
    ) -> None:
        self.faults: tuple[Fault, ...] = tuple(faults)
        self.rank = current_rank() if rank is None else rank
        # The trainer's pid, where the faults fire in a process it started: KILL_PARENT's
        # target, only while it is still this process's parent (see act).
        self.trainer = trainer
        self._fired = [0] * len(self.faults)
        self._lock = threading.Lock()

    def candidates(self, phase: Phase, path: str | None = None) -> list[tuple[int, Fault]]:
        """``(index, fault)`` of the faults that may still fire at ``phase`` for ``path``."""
        with self._lock:
            return [
                (k, fault)
                for k, fault in enumerate(self.faults)
                if fault.applies(self.rank, phase, path)
                and (fault.times is None or self._fired[k] < fault.times)
            ]

    def claim(self, index: int) -> bool:
        """Count one firing of fault ``index``; False if it has fired ``times`` already."""
        fault = self.faults[index]
        with self._lock:
            if fault.times is not None and self._fired[index] >= fault.times:
                return False
            self._fired[index] += 1
            return True

    def fire(self, phase: Phase, path: str | None = None) -> None:
        """Act on every fault that fires at ``phase`` (not for ``WRITE`` or ``DURING_CALL``)."""
        for index, fault in self.candidates(phase, path):
            if self.claim(index):
                where = f"{phase.value} of {path}" if path else phase.value
                act(fault, where, self.rank, self.trainer)

    @property
    def fired(self) -> int:
        return sum(self._fired)


def act(fault: Fault, where: str, rank: int, trainer: int | None = None) -> None:
    """Carry out ``fault``'s action (``CORRUPT`` is done by the stream, not here).

    ``KILL_PARENT`` kills this process's parent only while it is ``trainer`` (when known)
    and never pid 1: a parent that died first (another rank's failure took the job down)
    leaves this process adopted by a reaper, which must not be killed."""
    if fault.action == Action.RAISE:
        raise InjectedFault(
            fault.errno,
            f"{os.strerror(fault.errno)} (injected at {where} on rank {rank})",
        )
    if fault.action == Action.DELAY:
        time.sleep(fault.seconds)
    elif fault.action == Action.KILL:
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # SIGKILL is asynchronous only in theory; never carry on
    elif fault.action == Action.KILL_PARENT:
        parent = os.getppid()
        if parent != 1 and (trainer is None or parent == trainer):
            os.kill(parent, signal.SIGKILL)


def delay_within(fault: Fault) -> float:
    """The random firing time of a ``DURING_CALL`` fault."""
    return random.Random(fault.seed).uniform(0.0, fault.seconds)


def as_faults(faults: Fault | Sequence[Fault]) -> tuple[Fault, ...]:
    if isinstance(faults, Fault):
        return (faults,)
    result = tuple(faults)
    for fault in result:
        if not isinstance(fault, Fault):
            raise ConfigurationError(f"expected Fault values, got {fault!r}")
    return result
