"""Finalize for :class:`~.manager.TieredCheckpointManager`: commit what the background
finished, on every rank, and raise what failed.

A mixin, as :mod:`._loading` is for the read side: the manager module holds set-up and
save. It uses the manager's attributes (``_queue``, ``_pending``, ``timeouts``,
``_closed``). Two things finish a save: the worker call (its memory-tier report, and on a
durable save the durable files, committed by the call's finalize function) and the
replicator's commit of the memory tier (``PendingSave.memory.future``).
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint import CheckpointException

from .._logging import get_logger
from ..async_ckpt._callers import State
from ..config import Timeouts
from ..errors import CheckpointTimeoutError, CheckpointWriteError, QueueClosedError
from ._replicator import MemorySave

logger = get_logger(__name__)


@dataclass
class PendingSave:
    """A save not yet finalized: its step, worker call and memory-tier commit."""

    step: int
    call_idx: int
    memory: MemorySave
    durable: bool


class FinalizeSteps:
    """The manager's ``maybe_finalize`` and what it needs (mixed into the manager)."""

    timeouts: Timeouts
    _queue: Any
    _pending: deque[PendingSave]
    _closed: bool

    def maybe_finalize(self, blocking: bool = False) -> list[int]:
        """Commit what finished; return the steps newly committed in the memory tier.

        Collective. Durable saves whose write finished on every rank are committed here.
        A failure of either tier on any rank raises here on every rank (the first one;
        later ones are logged). ``blocking`` waits (with deadlines) for every pending save.
        """
        if self._closed:
            raise QueueClosedError("maybe_finalize on a closed TieredCheckpointManager")
        errors: list[BaseException] = []
        self._notice_finished_calls()
        try:
            self._queue.maybe_finalize_async_calls(blocking=blocking)
        except CheckpointException as exc:
            errors.append(CheckpointWriteError(f"durable commit failed: {exc}"))
        except BaseException as exc:
            errors.append(exc)
        self._notice_finished_calls()
        committed = self._collect_memory(blocking, errors)
        if errors:
            for extra in errors[1:]:
                logger.error("another tiered checkpoint failure: %r", extra)
            raise errors[0]
        return committed

    def _notice_finished_calls(self) -> None:
        """Tell the replicator which worker calls ended without their outcome reaching the
        call's reports (a call that failed before it reached the worker): a memory write
        that left no report is then a failure, not a wait until the deadline."""
        active = {a.idx for a in self._queue.async_calls}
        caller = self._queue.persistent_caller
        for pending in self._pending:
            reports = pending.memory.reports
            if reports is None or reports.ended:
                continue
            finished = pending.call_idx not in active
            if not finished and caller is not None:
                finished = caller.local_status(pending.call_idx).state != State.RUNNING
            if finished:
                reports.end()

    def _collect_memory(self, blocking: bool, errors: list[BaseException]) -> list[int]:
        committed = []
        deadline = time.monotonic() + self.timeouts.finalize
        while self._pending:
            pending = self._pending[0]
            future = pending.memory.future
            if blocking:
                try:
                    future.exception(timeout=max(0.0, deadline - time.monotonic()))
                except FutureTimeout:
                    errors.append(
                        CheckpointTimeoutError(
                            f"tiered save of step {pending.step}: the memory tier did not "
                            f"commit within {self.timeouts.finalize:.0f}s"
                        )
                    )
                    break
            elif not future.done():
                break
            self._pending.popleft()
            exc = future.exception()
            if exc is not None:
                errors.append(exc)
            else:
                committed.append(pending.step)
        return committed
