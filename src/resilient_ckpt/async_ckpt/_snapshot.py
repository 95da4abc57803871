"""A snapshot still being taken (overlapped staging), held by the caller until it is waited for.

Decision: ``schedule_async_request(..., overlap_staging=True)`` returns at once; the whole
staging (pickling the request, checking its layout against the staging cache, the arena,
the copy) runs on one background thread. The per-tensor Python work of a request of
thousands of tensors is then off the trainer's path as well as the copy. The request's
objects (its containers and values, not only its tensors) must stay unchanged until the
wait, and a request that cannot be pickled is reported by the wait instead of the call.

CUDA tensors are copied on side streams that wait for an event the call recorded on the
trainer's streams (:class:`._copy.DeviceOrder`): the copies read what the call
saw, and neither the trainer's stream nor the wait is held up by the other's work. (Before,
a process with CUDA pickled the request and issued every device copy in the call: 18-25 ms
for 2000 tensors on an H100, against a pinned copy loop's 13.6 ms.)

Only the trainer's thread reads the worker's results, so a background staging must never
wait for an arena: the caller makes sure one is free (or may be created) before starting it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from .._logging import get_logger
from ..errors import CheckpointTimeoutError, StagingError
from ._copy import ThreadPool
from ._staging import StagedRequest

logger = get_logger(__name__)

_STAGER_PREFIX = "resilient_ckpt-stage"
_STAGER = ThreadPool(_STAGER_PREFIX)

T = TypeVar("T")


def in_staging_order(fn: Callable[[], T]) -> T:
    """``fn()`` on the staging thread, after every background staging submitted before it.

    The planning of deferred saves (see :mod:`._deferred`) runs collectives on a group of
    its own; running it here keeps those collectives in the order the saves were staged in,
    the same on every rank, even when one queue's overlapped staging is still running while
    another queue (or the fork queue's ``preload_fn``) plans a save in the trainer's thread.
    """
    if threading.current_thread().name.startswith(_STAGER_PREFIX):
        return fn()
    return _STAGER.get(1).submit(fn).result()


def _timed(stage: Callable[[], StagedRequest]) -> tuple[StagedRequest, float]:
    started = time.perf_counter()
    staged = stage()
    return staged, time.perf_counter() - started


class PendingSnapshot:
    """One overlapped snapshot: its staging, running on the staging thread."""

    def __init__(self, call_idx: int, stage: Callable[[], StagedRequest]) -> None:
        self.call_idx = call_idx
        self._future: Future[tuple[StagedRequest, float]] | None = _STAGER.get(1).submit(
            _timed, stage
        )

    def wait(self, timeout: float) -> tuple[StagedRequest, float]:
        """The complete staged request and the staging's seconds. Raises what the staging
        raised; on a deadline, the staging still running releases its arena through
        ``release`` given to :meth:`abandon`."""
        if self._future is None:
            raise StagingError(f"snapshot of async request {self.call_idx} was already abandoned")
        try:
            staged, staging_s = self._future.result(timeout)
        except TimeoutError as exc:
            raise CheckpointTimeoutError(
                f"the snapshot of async request {self.call_idx} was not staged within "
                f"{timeout:.0f}s"
            ) from exc
        self._future = None
        return staged, staging_s

    def abandon(self, release: Callable[[int], None], timeout: float | None = None) -> None:
        """Give up this snapshot: its arena goes back to the pool once nothing writes it.

        ``timeout``: how long to wait for the staging here (None: do not wait; a staging
        still running then releases its arena when it ends).
        """
        future, self._future = self._future, None
        if future is None:
            return
        future.add_done_callback(lambda f: self._release_result(f, release))
        if timeout is not None:
            try:
                future.result(timeout)
            except BaseException as exc:  # reported by whoever waited, or lost with it
                logger.debug("abandoned staging of request %d: %r", self.call_idx, exc)

    @staticmethod
    def _release_result(future: Future[Any], release: Callable[[int], None]) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        staged, _ = future.result()
        if staged.arena is not None:
            release(staged.arena.arena_id)
