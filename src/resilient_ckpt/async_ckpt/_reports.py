"""Reports: small values that background code sends back to the trainer while it runs.

A DCP write tells the trainer what it wrote (files, sizes, CRC32s, DCP results, or its
failure) through a report under a key unique to the write. The report travels over the
channel the background process already has, never as a file in the checkpoint: a file per
rank and save is a PUT, a GET and a DELETE on an object store, thousands of metadata
operations per save on a large job.

:func:`post` goes, depending on where the background code runs, to a
:class:`._protocol.Report` message on the persistent worker's channel (sent at once, before
the call's ``Result``, so a report can be taken while the call still runs), to the pipe of
the child forked by :class:`._callers.TemporalAsyncCaller`, or, in the trainer itself
(``execute_sync``, ``dcp.save``), straight into the inbox. A background process installs a
sink (:func:`set_sink`); the trainer has none.

Trainer side: reports wait in one process-wide inbox until :func:`take`, which pumps the
callers' channels itself while it waits, from any thread, so a report never waits for the
training loop to poll. A report nobody takes belongs to a failed or abandoned save; the
inbox keeps at most :data:`KEEP`, oldest dropped first, which bounds memory while staying
far above the reports that can be in flight at once.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from .._logging import get_logger
from ..errors import CheckpointTimeoutError, CheckpointWriteError

logger = get_logger(__name__)

KEEP = 64
# How often a waiting take() reads the channels itself (reports the trainer thread reads
# wake it at once).
_PUMP_INTERVAL = 0.01


class Pump(Protocol):
    def pump_reports(self) -> None:
        """Read, without blocking, what has arrived on this caller's channel (any thread)."""


_sink: Callable[[str, Any], None] | None = None
_inbox: OrderedDict[str, Any] = OrderedDict()
_arrived = threading.Condition()
_pumps: weakref.WeakSet[Pump] = weakref.WeakSet()


# -- the background side ----------------------------------------------------------------------


def set_sink(sink: Callable[[str, Any], None] | None) -> None:
    """Where this process's :func:`post` sends reports (set by a background process at start;
    ``None``: this is the trainer).
    """
    global _sink
    _sink = sink


def post(key: str, value: Any) -> None:
    """Send ``value`` to the trainer under ``key``, now."""
    if _sink is None:
        deliver(key, value)
    else:
        _sink(key, value)


# -- the trainer side -------------------------------------------------------------------------


def deliver(key: str, value: Any) -> None:
    """Put a received report into the inbox (a caller reading its channel calls this)."""
    with _arrived:
        _inbox[key] = value
        _inbox.move_to_end(key)
        while len(_inbox) > KEEP:
            old, _ = _inbox.popitem(last=False)
            logger.warning("dropped the report %s that no one took (a failed save's)", old)
        _arrived.notify_all()


def register_pump(pump: Pump) -> None:
    """Have :func:`take` read ``pump``'s channel while it waits (held weakly)."""
    _pumps.add(pump)


def take(
    key: str,
    *,
    rank: int,
    what: str,
    timeout: float = 0.0,
    ended: Callable[[], bool] | None = None,
) -> Any:
    """Remove and return the report posted under ``key``.

    Waits up to ``timeout`` seconds, reading the callers' channels meanwhile; ``ended`` says
    when the call that would post it is over. Raises ``CheckpointWriteError`` when there is no
    report and the call is over (or no wait was asked for), ``CheckpointTimeoutError`` past the
    deadline; both name ``rank`` and ``what`` was expected to report.
    """
    deadline = time.monotonic() + timeout
    while True:
        over = ended is not None and ended()  # read before the last look: no report lost
        for pump in list(_pumps):
            pump.pump_reports()
        with _arrived:
            if key in _inbox:
                return _inbox.pop(key)
            remaining = deadline - time.monotonic()
            if over or timeout <= 0:
                raise CheckpointWriteError(
                    f"rank {rank}: {what} ended without reporting (did the background "
                    "request run? was it scheduled and waited for?)",
                    rank=rank,
                )
            if remaining <= 0:
                raise CheckpointTimeoutError(
                    f"rank {rank}: {what} did not report within {timeout:.0f}s"
                )
            _arrived.wait(min(remaining, _PUMP_INTERVAL))
