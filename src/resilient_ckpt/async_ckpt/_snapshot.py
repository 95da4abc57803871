"""A snapshot still being taken (overlapped staging), held by the caller until it is waited for.

Decision: ``schedule_async_request(..., overlap_staging=True)`` returns before the snapshot
is complete, in one of two forms:

* **Background staging** (processes where CUDA is not initialised, so every tensor is on the
  host): the whole staging (pickling the request, checking its layout against the staging
  cache, the arena, the copy) runs on one background thread and the call returns at once.
  The per-tensor Python work of a request of thousands of tensors is then off the trainer's
  path as well as the copy. The request's objects (its containers and values, not only its
  tensors) must stay unchanged until the wait, and a request that cannot be pickled is
  reported by the wait instead of the call.
* **Background copy** (CUDA initialised): the request is pickled in the call and only the
  copy runs in the background. Device-to-host copies are issued from the trainer's thread,
  on its current stream, so they are ordered after the kernels that produced the values.

Only the trainer's thread reads the worker's results, so a background staging must never
wait for an arena: the caller makes sure one is free (or may be created) before starting it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from .._logging import get_logger
from ..errors import CheckpointTimeoutError, StagingError
from ._copy import ThreadPool
from ._staging import StagedRequest

logger = get_logger(__name__)

_STAGER_PREFIX = "resilient_ckpt-stage"
_STAGER = ThreadPool(_STAGER_PREFIX)

T = TypeVar("T")


def stages_in_background() -> bool:
    """Whether overlapped staging takes the background-staging form in this process."""
    return not torch.cuda.is_initialized()


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
    """One overlapped snapshot: a staged request whose copy runs, or a running staging."""

    def __init__(
        self,
        call_idx: int,
        *,
        staged: StagedRequest | None = None,
        stage: Callable[[], StagedRequest] | None = None,
    ) -> None:
        self.call_idx = call_idx
        self._staged = staged
        self._future: Future[tuple[StagedRequest, float]] | None = None
        if stage is not None:
            self._future = _STAGER.get(1).submit(_timed, stage)

    def wait(self, timeout: float) -> tuple[StagedRequest, float | None]:
        """The complete staged request, and the background staging's seconds (None for the
        background-copy form). Raises what the staging raised; on a deadline, the staging
        still running releases its arena through ``release`` given to :meth:`abandon`."""
        staging_s: float | None = None
        if self._future is not None:
            try:
                self._staged, staging_s = self._future.result(timeout)
            except TimeoutError as exc:
                raise CheckpointTimeoutError(
                    f"the snapshot of async request {self.call_idx} was not staged within "
                    f"{timeout:.0f}s"
                ) from exc
            self._future = None
        staged = self._staged
        if staged is None:
            raise StagingError(f"snapshot of async request {self.call_idx} was already abandoned")
        if staged.copy is not None:
            staged.copy.wait(timeout)
        return staged, staging_s

    def abandon(self, release: Callable[[int], None], timeout: float | None = None) -> None:
        """Give up this snapshot: its arena goes back to the pool once nothing writes it.

        ``timeout``: how long to wait for a running copy or staging here (None: do not wait;
        a staging still running then releases its arena when it ends).
        """
        future, self._future = self._future, None
        if future is not None:
            future.add_done_callback(lambda f: self._release_result(f, release))
            if timeout is not None:
                try:
                    future.result(timeout)
                except BaseException as exc:  # reported by whoever waited, or lost with it
                    logger.debug("abandoned staging of request %d: %r", self.call_idx, exc)
            return
        staged, self._staged = self._staged, None
        if staged is None:
            return
        if staged.copy is not None:
            if timeout is not None:
                try:
                    staged.copy.wait(timeout)
                except Exception as exc:
                    logger.debug("overlapped copy of request %d failed: %r", self.call_idx, exc)
            if not staged.copy.done():
                # Released now, the arena could take the next snapshot while this copy still
                # writes into it: keep it out of the pool instead.
                logger.warning(
                    "staging arena of async request %d stays reserved: its copy still runs",
                    self.call_idx,
                )
                return
        if staged.arena is not None:
            release(staged.arena.arena_id)

    @staticmethod
    def _release_result(future: Future[Any], release: Callable[[int], None]) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        staged, _ = future.result()
        if staged.arena is not None:
            release(staged.arena.arena_id)
