"""Reports: small values that background code sends back to the trainer while it runs.

A DCP write tells the trainer what it wrote (files, sizes, CRC32s, DCP results, or its
failure) through a report under a key unique to the write. The report travels over the
connection the background process already has, never as a file in the checkpoint: a file
per rank and save is a PUT, a GET and a DELETE on an object store, thousands of metadata
operations per save on a large job.

Where a report lands is explicit, and never process-wide:

* **From a background process**, on the one connection that also carries the call's
  outcome: the persistent worker's channel (a :class:`._protocol.Report` naming the call,
  sent at once, before the call's ``Result``) or the pipe of the child forked by
  :class:`._callers.TemporalAsyncCaller`. A background process installs a sink
  (:func:`set_sink`) at start. In the trainer, each caller has one receiver thread that
  blocks on that connection and files what it reads in the caller's :class:`Mailbox`: the
  outcomes, and each call's :class:`Reports`, under one condition. A waiting :meth:`Reports.take`
  wakes when the report arrives or when the call's outcome does (the call ended without
  one); nothing polls.
* **In the trainer itself** (``execute_sync``, ``dcp.save``, a save function called
  directly), :func:`post` puts the report into the :class:`Reports` it is given, the one
  the write's own job carries; there the write is over before anyone takes its report.
* **The finalize** of a call (a zero-argument function: NVRx's signature, which no box can
  be passed through) finds the call's reports in :func:`of_call_being_finalized`, which the
  queue sets while it runs that call's finalize functions (:func:`finalizing`). A thread
  that waits for a report while the call runs (the tiered manager's replicator) is handed
  the call's :class:`Reports` by the queue instead.

The alternative, one inbox per process that every take searched while pumping every
caller's channel, needed a registry of callers and a polling loop, and kept reports of
abandoned saves until a bound dropped them; here a call's reports go when its caller
forgets the call.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import CheckpointTimeoutError, CheckpointWriteError

_sink: Callable[[str, Any], None] | None = None
_MISSING = object()


class Reports:
    """The reports of one call (or of one in-trainer write), by key, under a condition that
    a caller shares with its outcomes. :meth:`end`: no report is coming any more.

    A box belongs to the process that made it: pickled, it arrives empty (a write job that
    carries one into a background process posts through the sink there).
    """

    def __init__(self, condition: threading.Condition | None = None) -> None:
        self._condition = condition or threading.Condition()
        self._values: dict[str, Any] = {}
        self.ended = False

    def __reduce__(self) -> tuple[type[Reports], tuple[()]]:
        return Reports, ()

    def put(self, key: str, value: Any) -> None:
        with self._condition:
            self._values[key] = value
            self._condition.notify_all()

    def end(self) -> None:
        with self._condition:
            self.ended = True
            self._condition.notify_all()

    def pop(self, key: str) -> Any:
        """The report under ``key``, removed, or :data:`_MISSING` (no wait)."""
        with self._condition:
            return self._values.pop(key, _MISSING)

    def take(self, key: str, *, rank: int, what: str, timeout: float = 0.0) -> Any:
        """Remove and return the report under ``key``, waiting up to ``timeout`` seconds
        while the call runs; see :func:`take` for the errors."""
        deadline = time.monotonic() + timeout
        with self._condition:
            while key not in self._values:
                if self.ended or timeout <= 0:
                    raise _ended_without(rank, what)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CheckpointTimeoutError(
                        f"rank {rank}: {what} did not report within {timeout:.0f}s"
                    )
                self._condition.wait(remaining)
            return self._values.pop(key)


def _ended_without(rank: int, what: str) -> CheckpointWriteError:
    return CheckpointWriteError(
        f"rank {rank}: {what} ended without reporting (did the background request run? was "
        "it scheduled and waited for?)",
        rank=rank,
    )


class Mailbox:
    """One caller's receiving side: what its receiver thread read off the connection (each
    call's outcome, in arrival order, and its reports), under one condition. The thread
    holds the mailbox, never the caller, so a caller nobody references is still collected.
    """

    def __init__(self) -> None:
        self.condition = threading.Condition()
        self._outcomes: deque[Any] = deque()
        self._reports: dict[int, Reports] = {}
        # Calls are forgotten oldest first; a late report of a forgotten call is dropped.
        self._forgotten = -1
        self.closed = False

    def reports_of(self, call_idx: int) -> Reports:
        with self.condition:
            box = self._reports.get(call_idx)
            if box is None:
                box = Reports(self.condition)
                if call_idx <= self._forgotten or self.closed:
                    box.ended = True
                else:
                    self._reports[call_idx] = box
            return box

    def report(self, call_idx: int, key: str, value: Any) -> None:
        self.reports_of(call_idx).put(key, value)

    def outcome(self, call_idx: int, message: Any) -> None:
        """File ``call_idx``'s outcome; it sends no more reports."""
        with self.condition:
            self._outcomes.append(message)
            self.reports_of(call_idx).end()

    def close(self) -> None:
        """The connection is gone: no outcome or report is coming any more."""
        with self.condition:
            self.closed = True
            for box in self._reports.values():
                box.end()
            self.condition.notify_all()

    def reopen(self) -> None:
        """A new connection (a restarted worker) delivers from now on."""
        with self.condition:
            self.closed = False

    def end_call(self, call_idx: int) -> None:
        """``call_idx`` is over without an outcome on the connection (it never reached it)."""
        self.reports_of(call_idx).end()

    def take_outcomes(self) -> tuple[list[Any], bool]:
        """The outcomes filed so far (removed), and whether the connection is gone; outcomes
        filed before the connection went are all in the list."""
        with self.condition:
            outcomes = list(self._outcomes)
            self._outcomes.clear()
            return outcomes, self.closed

    def wait(self, timeout: float) -> None:
        """Until an outcome is filed, the connection goes, or ``timeout`` passes."""
        with self.condition:
            self.condition.wait_for(lambda: self._outcomes or self.closed, timeout)

    def wait_closed(self, timeout: float) -> bool:
        """Until the connection goes or ``timeout`` passes; whether it went."""
        with self.condition:
            return self.condition.wait_for(lambda: self.closed, timeout)

    def forget(self, call_idx: int) -> None:
        """Drop the reports of ``call_idx`` and of every older call."""
        with self.condition:
            self._forgotten = max(self._forgotten, call_idx)
            for idx in [i for i in self._reports if i <= call_idx]:
                del self._reports[idx]


# -- the background side ----------------------------------------------------------------------


def set_sink(sink: Callable[[str, Any], None] | None) -> None:
    """Where this process's :func:`post` sends reports (set by a background process at start;
    ``None``: this is the trainer).
    """
    global _sink
    _sink = sink


def post(reports: Reports, key: str, value: Any) -> None:
    """Send ``value`` to the trainer under ``key``, now: through this process's sink, or, in
    the trainer, into ``reports``."""
    if _sink is None:
        reports.put(key, value)
    else:
        _sink(key, value)


# -- the trainer side -------------------------------------------------------------------------

_being_finalized: contextvars.ContextVar[Reports | None] = contextvars.ContextVar(
    "resilient_ckpt_reports_being_finalized", default=None
)


@contextlib.contextmanager
def finalizing(reports: Reports | None) -> Iterator[None]:
    """While the finalize functions of the call whose reports are ``reports`` run."""
    token = _being_finalized.set(reports)
    try:
        yield
    finally:
        _being_finalized.reset(token)


def of_call_being_finalized() -> Reports | None:
    return _being_finalized.get()


def take(
    key: str,
    *,
    rank: int,
    what: str,
    local: Reports | None = None,
    call: Reports | None = None,
    timeout: float = 0.0,
) -> Any:
    """Remove and return the report posted under ``key``: from ``local`` (posted in the
    trainer), else from ``call`` (the call's, default: the call being finalized), waiting up
    to ``timeout`` seconds while the call runs.

    Raises ``CheckpointWriteError`` when there is no report and the call is over (or no wait
    was asked for, or no call is known), ``CheckpointTimeoutError`` past the deadline; both
    name ``rank`` and what was expected to report.
    """
    if local is not None:
        value = local.pop(key)
        if value is not _MISSING:
            return value
    if call is None:
        call = of_call_being_finalized()
    if call is None:
        raise _ended_without(rank, what)
    return call.take(key, rank=rank, what=what, timeout=timeout)
