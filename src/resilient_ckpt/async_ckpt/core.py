"""Async checkpointing core: requests, callers, and the queue that finalizes them.

Public, NVRx-compatible names: :class:`AsyncRequest`, :class:`AsyncCallsQueue`,
:class:`AsyncCaller`, :class:`TemporalAsyncCaller`, :class:`PersistentAsyncCaller`,
:func:`abort_nvrx_checkpoint`.

Call protocol of :class:`AsyncCallsQueue` (every rank makes every call, in the same order):

1. ``schedule_async_request(request)`` returns the call index. The request's tensors are
   snapshotted before it returns; the write runs in the background. A request that cannot
   be staged (a value that does not pickle) raises here, on this rank only, and stays
   queued as a failed call: the next finalize raises for it on every rank, so a rank that
   catches the error and carries on stays in the same collectives as the others.
2. ``maybe_finalize_async_calls(blocking, no_dist)`` finalizes, oldest first, each call that
   is done *on all ranks* (unless ``no_dist``): its finalize functions run in the trainer,
   once, in FIFO order, and its index is returned. A call that failed on any rank raises
   on every rank (a :class:`~resilient_ckpt.errors.WorkerError` naming the ranks); a
   blocking wait past the deadline raises :class:`~resilient_ckpt.errors.CheckpointTimeoutError`.
3. ``close(abort)`` finalizes what is pending (or drops it when ``abort``) and stops the
   worker. A later ``schedule_async_request`` starts a fresh worker, as in NVRx.
"""

from __future__ import annotations

import atexit
import time
import weakref
from collections import deque
from typing import Any, ClassVar, NamedTuple

from .. import _telemetry
from .._logging import get_logger
from ..config import Timeouts, WorkerOptions, default_timeouts
from ..errors import QueueClosedError
from . import _reports
from ._callers import (
    AsyncCaller,
    AsyncRequest,
    FailedCall,
    TemporalAsyncCaller,
    agree_on_call,
    is_agreed,
    staging_error,
    validate_request,
)
from ._copy import check_copy_threads
from ._persistent import PersistentAsyncCaller
from ._reports import Reports

logger = get_logger(__name__)

__all__ = [
    "AsyncCallsQueue",
    "AsyncCaller",
    "AsyncRequest",
    "PersistentAsyncCaller",
    "TemporalAsyncCaller",
    "abort_nvrx_checkpoint",
]


class _ActiveAsyncRequest(NamedTuple):
    idx: int
    async_caller: AsyncCaller
    async_request: AsyncRequest


class AsyncCallsQueue:
    """Schedules :class:`AsyncRequest` objects and finalizes them across ranks.

    Args:
        persistent: one long-lived worker process (True, default) or a fork per request.
        is_daemon, cpu_priority, io_priority, sigterm_timeout, cpu_shm_mode: passed to
            :class:`PersistentAsyncCaller`.
        timeouts: deadlines for every wait (default:
            :func:`resilient_ckpt.config.default_timeouts`).
        max_staging_buffers: how many staging arenas may exist at once (bounds host memory
            to this many snapshots; a further save waits for an earlier one to finish).
        copy_threads: threads copying a snapshot into shared memory (default
            ``min(4, cores / local ranks)``, or ``RESILIENT_CKPT_COPY_THREADS``).
        otel_bootstrap: how the worker sets up OpenTelemetry (NVRx's keyword, a plain dict;
            see the docs' Observability page); None: from the environment alone.
    """

    _instances: ClassVar[weakref.WeakSet[AsyncCallsQueue]] = weakref.WeakSet()
    _warmup_persistent_caller: ClassVar[PersistentAsyncCaller | None] = None

    def __init__(
        self,
        persistent: bool = True,
        is_daemon: bool = True,
        cpu_priority: int | None = 10,
        io_priority: int | None = None,
        sigterm_timeout: float = 30.0,
        cpu_shm_mode: bool = False,
        otel_bootstrap: dict[str, Any] | None = None,
        *,
        timeouts: Timeouts | None = None,
        max_staging_buffers: int = 2,
        copy_threads: int | None = None,
    ) -> None:
        # Validated now, not when the worker is first started by a save.
        WorkerOptions(is_daemon, cpu_priority, io_priority, sigterm_timeout, cpu_shm_mode)
        self.otel_bootstrap = _telemetry.check_bootstrap(otel_bootstrap)
        self.persistent = persistent
        self.is_daemon = is_daemon
        self.cpu_priority = cpu_priority
        self.io_priority = io_priority
        self.sigterm_timeout = sigterm_timeout
        self.cpu_shm_mode = cpu_shm_mode
        self.timeouts = timeouts or default_timeouts()
        self.max_staging_buffers = max_staging_buffers
        self.copy_threads = check_copy_threads(copy_threads)
        self.async_calls: deque[_ActiveAsyncRequest] = deque()
        self.call_idx = -1
        self.persistent_caller: PersistentAsyncCaller | None = None
        self._closed = False
        # Per-call timings (seconds): stage (trainer stall), preload/write (worker), finalize.
        self.timings: dict[int, dict[str, float]] = {}
        AsyncCallsQueue._instances.add(self)

    @classmethod
    def get_instances(cls) -> list[AsyncCallsQueue]:
        return list(cls._instances)

    def _get_async_caller(self) -> AsyncCaller:
        if not self.persistent:
            return TemporalAsyncCaller(self.timeouts)
        if self.persistent_caller is None:
            warmed = AsyncCallsQueue._warmup_persistent_caller
            if warmed is not None:
                AsyncCallsQueue._warmup_persistent_caller = None
                warmed.timeouts = self.timeouts
                if self.otel_bootstrap is not None and warmed.otel_bootstrap != self.otel_bootstrap:
                    logger.warning(
                        "the pre-warmed checkpoint worker keeps the otel_bootstrap it was "
                        "started with; pass this queue's to warmup_persistent_caller instead"
                    )
                self.persistent_caller = warmed
            else:
                self.persistent_caller = PersistentAsyncCaller(
                    is_daemon=self.is_daemon,
                    cpu_priority=self.cpu_priority,
                    io_priority=self.io_priority,
                    sigterm_timeout=self.sigterm_timeout,
                    cpu_shm_mode=self.cpu_shm_mode,
                    otel_bootstrap=self.otel_bootstrap,
                    timeouts=self.timeouts,
                    max_staging_buffers=self.max_staging_buffers,
                    copy_threads=self.copy_threads,
                )
        return self.persistent_caller

    @classmethod
    def warmup_persistent_caller(
        cls,
        rank: int,
        is_daemon: bool = True,
        cpu_priority: int | None = 10,
        io_priority: int | None = None,
        sigterm_timeout: float = 30.0,
        cpu_shm_mode: bool = False,
        otel_bootstrap: dict[str, Any] | None = None,
    ) -> None:
        """Start a persistent worker now, so the first save does not pay its start-up.

        ``otel_bootstrap`` (NVRx's keyword): how the worker sets up OpenTelemetry, a plain
        dict (see the docs' Observability page); None: from the environment alone.
        """
        if cls._warmup_persistent_caller is None:
            caller = PersistentAsyncCaller(
                is_daemon=is_daemon,
                cpu_priority=cpu_priority,
                io_priority=io_priority,
                sigterm_timeout=sigterm_timeout,
                cpu_shm_mode=cpu_shm_mode,
                otel_bootstrap=otel_bootstrap,
            )
            caller.start(rank=rank, wait_ready=False)
            cls._warmup_persistent_caller = caller

    def warmup(self, state_dict: Any = None, *, nbytes: int | None = None) -> None:
        """Make the first save as cheap as a steady one (persistent queues; else a no-op).

        Starts the worker and the copy threads, hands the worker a pre-faulted staging arena sized
        for ``state_dict``'s tensors (or ``nbytes``), and primes the staging cache with their
        layout, so a first request meeting the same tensors in the same order takes the
        steady-state path. Pass the object your saves will stage, on every rank.
        """
        caller = self._get_async_caller()
        if isinstance(caller, PersistentAsyncCaller):
            caller.warmup(state_dict, nbytes=nbytes)

    def schedule_async_request(
        self, async_request: AsyncRequest, *, overlap_staging: bool = False
    ) -> int:
        """Snapshot and start ``async_request``; returns its call index. All ranks call this.

        ``overlap_staging=True`` (persistent queues) returns before the tensors are copied: the
        staging runs on a background thread while training goes on, and :meth:`wait_for_snapshot`
        must be called before anything modifies the request's tensors or objects (e.g. before
        ``optimizer.step()``). Any later call on this queue waits for it too.
        """
        request = validate_request(async_request)
        caller = self._get_async_caller()
        self._closed = False
        call_idx = self.call_idx + 1
        frozen = request.freeze()
        started = time.perf_counter()
        to_schedule = frozen._replace(call_idx=call_idx, finalize_fns=[])
        try:
            if isinstance(caller, PersistentAsyncCaller):
                caller.schedule_async_call(to_schedule, overlap_staging=overlap_staging)
            else:  # a forked child snapshots by copy-on-write when it starts
                caller.schedule_async_call(to_schedule)
        except Exception as exc:
            if is_agreed(exc):
                self.call_idx = call_idx
                raise  # a deferred planning's: every rank raises it here, nothing to queue
            # This rank raises now; the call stays queued as failed, so the next finalize
            # meets the other ranks in their agreement on it and raises there on all of them.
            error = staging_error(exc, to_schedule)
            self.call_idx = call_idx
            self.async_calls.append(
                _ActiveAsyncRequest(call_idx, FailedCall(call_idx, error), frozen)
            )
            if error is exc:
                raise
            raise error from exc
        self.call_idx = call_idx
        self.timings[call_idx] = {"stall": time.perf_counter() - started}
        # Ownership of what the write reads ends here: the caller holds its snapshot (or,
        # for a fork, the execution itself), so the trainer's tensors are not kept alive
        # until finalize by this queue. Only the finalize functions stay.
        active = frozen._replace(
            call_idx=call_idx,
            async_fn=None,
            async_fn_args=(),
            async_fn_kwargs=None,
            preload_fn=None,
        )
        self.async_calls.append(_ActiveAsyncRequest(call_idx, caller, active))
        return call_idx

    def wait_for_snapshot(self, timeout: float | None = None) -> None:
        """Wait until the last overlapped save's tensors are copied (a no-op otherwise).

        After it returns the saved tensors may change: the checkpoint holds their values
        at ``schedule_async_request`` time.
        """
        if self.persistent_caller is not None:
            started = time.perf_counter()
            self.persistent_caller.wait_for_snapshot(timeout)
            if self.call_idx in self.timings:
                self.timings[self.call_idx]["snapshot_wait"] = time.perf_counter() - started

    def maybe_finalize_async_calls(
        self, blocking: bool = False, no_dist: bool = False
    ) -> list[int]:
        """Finalize every call done on all ranks, oldest first; returns their indices."""
        if self._closed and not self.async_calls:
            raise QueueClosedError(
                "maybe_finalize_async_calls on a closed AsyncCallsQueue; schedule a new "
                "request (which restarts the worker) or create a new queue"
            )
        finalized: list[int] = []
        while self.async_calls:
            idx, caller, request = self.async_calls[0]
            try:
                done = agree_on_call(caller, idx, blocking, no_dist, self.timeouts)
            except BaseException as exc:
                self.async_calls.popleft()
                _telemetry.end_save(caller, idx, self.timings.get(idx), exc)
                caller.forget(idx)
                if caller is not self.persistent_caller:
                    # The call failed on some rank (a timeout, a peer's error): its forked
                    # child can only write files nobody commits, and would outlive us.
                    caller.close(abort=True)
                raise
            if not done:
                break
            self.async_calls.popleft()
            reports = caller.reports_of(idx)
            caller.forget(idx)
            started = time.perf_counter()
            with _telemetry.finalizing(caller, idx), _reports.finalizing(reports):
                for finalize_fn in request.finalize_fns:
                    finalize_fn()
            stats = self.timings.setdefault(idx, {})
            stats["finalize"] = time.perf_counter() - started
            stats.update(getattr(caller, "timings", {}).get(idx, {}))
            _telemetry.end_save(caller, idx, stats)
            finalized.append(idx)
            logger.info(
                "finalized async request %d (stall %.4fs, write %.4fs, finalize %.4fs)",
                idx,
                stats.get("stall", 0.0),
                stats.get("write", 0.0),
                stats["finalize"],
            )
        if len(self.timings) > 256:
            for old in sorted(self.timings)[:-128]:
                del self.timings[old]
        return finalized

    def reports_of(self, call_idx: int) -> Reports | None:
        """Where the reports of the queued call ``call_idx`` arrive, to wait for one while
        it runs (None: not queued, or it posts none)."""
        for active in self.async_calls:
            if active.idx == call_idx:
                return active.async_caller.reports_of(call_idx)
        return None

    def get_num_unfinalized_calls(self) -> int:
        return len(self.async_calls)

    def close(self, abort: bool = False) -> list[int]:
        """Finalize pending calls (or drop them with ``abort``) and stop the worker.

        Returns the indices of the calls that were dropped unfinished. Without ``abort``
        this is collective (it finalizes across ranks); a failure of a pending call is
        re-raised after the worker has been stopped.
        """
        error: BaseException | None = None
        dropped: list[int] = []
        if not abort:
            try:
                while self.async_calls:
                    self.maybe_finalize_async_calls(blocking=True)
            except BaseException as exc:
                error = exc
        for active in self.async_calls:
            dropped.append(active.idx)
            if active.async_caller is not self.persistent_caller:
                active.async_caller.close(abort=True)  # a forked child of a dropped call
        self.async_calls.clear()
        if self.persistent_caller is not None:
            self.persistent_caller.close(abort=abort or error is not None)
            self.persistent_caller = None
        self._closed = True
        if dropped:
            logger.warning("async calls %s dropped by close(abort=%s)", dropped, abort)
        if error is not None:
            raise error
        return dropped

    def _abandon(self) -> None:
        """Interpreter exit or garbage collection: no collectives, no finalize functions; the worker
        gets the shutdown deadline to finish its queued writes, then is stopped.
        """
        self.async_calls.clear()
        if self.persistent_caller is not None:
            self.persistent_caller.close(abort=False)
            self.persistent_caller = None

    def __del__(self) -> None:
        try:
            self._abandon()
        except Exception as exc:  # garbage collection must not raise; say what was lost
            logger.warning("could not stop the worker of a discarded queue: %s", exc)


def abort_nvrx_checkpoint() -> None:
    """Abort every live queue's pending checkpoints and stop their workers (NVRx name).

    Meant for in-process restarts: the queues stay usable (unlike after their own
    ``close()``), so finalizing one with nothing pending returns ``[]`` and the next
    request starts a fresh worker.
    """
    for queue in AsyncCallsQueue.get_instances():
        queue.close(abort=True)
        queue._closed = False
    warmed = AsyncCallsQueue._warmup_persistent_caller
    if warmed is not None:
        warmed.close(abort=True)
        AsyncCallsQueue._warmup_persistent_caller = None


@atexit.register
def _stop_workers_at_exit() -> None:
    for queue in AsyncCallsQueue.get_instances():
        try:
            queue._abandon()
        except Exception as exc:  # the next queue's worker must still be stopped
            logger.warning("could not stop a checkpoint worker at exit: %s", exc)
    warmed = AsyncCallsQueue._warmup_persistent_caller
    if warmed is not None:
        warmed.close(abort=True)
