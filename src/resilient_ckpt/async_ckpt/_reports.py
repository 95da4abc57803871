"""Reports: small values that background code sends back to the trainer while it runs.

A DCP write tells the trainer what it wrote (files, sizes, CRC32s, DCP results, or its
failure) through a report, posted under a key unique to the write (its job's token). The
report travels over the channel the background process already has with the trainer, so a
save costs no extra file in the checkpoint (on an object store, a PUT, a GET and a DELETE
per rank per save).

Where :func:`post` goes depends on where the background code runs:

* the persistent worker: a :class:`._worker.Report` message on its channel, sent at once,
  before the call's ``Result`` (so a report can be taken while the call is still running,
  as the tiered manager does for its memory tier);
* the child forked by :class:`._callers.TemporalAsyncCaller`: its pipe to the trainer;
* the trainer itself (``execute_sync``, ``dcp.save``): straight into the inbox.

The process that installs a sink (:func:`set_sink`) is a background process; the trainer
has none. On the trainer side received reports wait in one process-wide inbox until
:func:`take`; the callers that read channels register as *pumps*, and :func:`take` pumps
them itself while it waits, from any thread, so a report never waits for the training loop
to poll its queue.

A report nobody takes belongs to a save that failed or was abandoned (its finalize never
ran). The inbox keeps at most :data:`KEEP` such reports, the oldest go first: memory stays
bounded over any number of failed saves, while far more reports than can be in flight at
once (a queue has at most a few staged saves, each with a report per tier) stay available.
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
    """Where this process's :func:`post` sends reports (a background process sets it at
    start; ``None``: this process is the trainer)."""
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

    Waits up to ``timeout`` seconds, reading the callers' channels meanwhile; ``ended``
    tells when the background call that would post it is over (then waiting is pointless).
    Raises ``CheckpointWriteError`` when there is no report and the call is over (or no
    wait was asked for), ``CheckpointTimeoutError`` past the deadline; both name ``rank``
    and ``what`` was expected to report.
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
