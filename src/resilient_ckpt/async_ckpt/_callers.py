"""Requests and their callers: ``AsyncRequest`` (what to run in the background and what to run
after, on every rank), the caller interface, the cross-rank decision on each call, and the
fork-per-request caller.

Call protocol of an :class:`AsyncCaller` (every method runs in the trainer process):

1. ``schedule_async_call(request)`` on every rank, in the same order. When it returns the
   request's content is fixed (snapshot taken) and the write is under way.
2. ``local_status(call_idx)`` (non-blocking) or ``wait_local(call_idx, timeout)``: this
   rank's view of one call: running, done, or failed with an exception.
3. :func:`agree_on_call` turns the local views into one decision on every rank; the queue
   then runs the finalize functions, or raises on every rank.
4. ``close(abort)`` ends the background process(es); ``abort`` drops pending calls.

Each poll in step 3 is one :func:`resilient_ckpt._dist.agree` on the library's gloo group,
carrying ``(state, call_idx, deadline_passed)`` per rank and this rank's error if it failed.
Since every rank sees every record, all take the same decision (finalize, wait, raise) and
the collectives stay in step.

:class:`TemporalAsyncCaller` (deprecated in NVRx, kept for compatibility) forks one child per
request: the fork is the snapshot of CPU memory (copy-on-write), so CUDA tensors must be
moved to the host by ``preload_fn``, which runs in the trainer before the fork. The child's
exception comes back as a value over the pipe that also carries its reports
(:mod:`._reports`); the trainer reads that pipe while the child runs, so a report larger
than the pipe's buffer never blocks the child.
"""

from __future__ import annotations

import enum
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

import torch

from .. import _dist
from .._logging import get_logger
from .._unpicklable import describe_unpicklable
from ..config import Timeouts, default_timeouts
from ..errors import (
    AsyncCallFailedError,
    CheckpointingException,
    CheckpointTimeoutError,
    FrozenRequestError,
    InvalidRequestError,
    RemoteTraceback,
    StagingError,
    WorkerDiedError,
)
from . import _reports
from ._protocol import RemoteFailure, Report
from ._staging import PlanStep
from ._worker import arm_parent_death_signal

logger = get_logger(__name__)


class AsyncRequest(NamedTuple):
    """A unit of background work and its finalization (NVRx-compatible field order).

    Args:
        async_fn: run in the background (worker process); ``None`` is a no-op.
        async_fn_args: positional arguments of ``async_fn``.
        finalize_fns: run in the trainer, in order, once ``async_fn`` is done on all ranks.
        async_fn_kwargs: keyword arguments of ``async_fn``.
        preload_fn: zero-argument callable run in the background before ``async_fn``; its
            return value replaces ``async_fn_args[1]`` (by convention, the state dict). A
            :class:`._staging.PlanStep` (a save made with ``defer_planning=True``) is that
            save's planning: the persistent queue runs it where it stages the request,
            other callers when they call it.
        is_frozen: once frozen (on scheduling), finalize functions can't be added.
        call_idx: set by the queue; orders requests across ranks.
    """

    async_fn: Callable[..., Any] | None
    async_fn_args: tuple | list
    finalize_fns: list[Callable[[], Any]]
    async_fn_kwargs: dict | None = None
    preload_fn: Callable[[], Any] | None = None
    is_frozen: bool = False
    call_idx: int = 0

    def add_finalize_fn(self, fn: Callable[[], Any]) -> None:
        """Append ``fn`` to the finalize functions (runs after the existing ones)."""
        if self.is_frozen:
            raise FrozenRequestError(
                "cannot add a finalize function to a frozen AsyncRequest (it was already "
                "scheduled); add finalize functions before schedule_async_request"
            )
        if not callable(fn):
            raise InvalidRequestError(f"finalize function must be callable, got {fn!r}")
        self.finalize_fns.append(fn)

    def freeze(self) -> AsyncRequest:
        """A copy of this request with ``is_frozen=True``."""
        return self._replace(is_frozen=True)

    def execute_sync(self) -> None:
        """Run the request synchronously in this process: preload, write, barrier, finalize."""
        validate_request(self)
        args = list(self.async_fn_args)
        if self.preload_fn is not None:
            args[1] = checked_preload(self.preload_fn)
        if self.async_fn is not None:
            self.async_fn(*args, **(self.async_fn_kwargs or {}))
        _dist.barrier()
        self.execute_finalize_fns(validate_matching_call_idx=False)

    def execute_finalize_fns(self, validate_matching_call_idx: bool = True) -> int:
        """Run the finalize functions; optionally check every rank finalizes this call_idx."""
        for fn in self.finalize_fns:
            fn()
        if validate_matching_call_idx:
            highest = _dist.max_int(self.call_idx)
            if highest != self.call_idx:
                raise InvalidRequestError(
                    f"rank {_dist.rank()} finalized async call {self.call_idx} while "
                    f"another rank finalized call {highest}: every rank must schedule and "
                    "finalize the same requests in the same order"
                )
        return self.call_idx


def checked_preload(preload_fn: Callable[[], Any]) -> Any:
    replacement = preload_fn()
    if replacement is None:
        raise InvalidRequestError(
            "preload_fn returned None; it must return the replacement for async_fn_args[1] "
            "(the state dict to write)"
        )
    return replacement


def validate_request(request: Any) -> AsyncRequest:
    """Check a request's fields before anything runs; upgrade look-alike tuples."""
    if not isinstance(request, AsyncRequest):
        fields = getattr(request, "_asdict", None)
        if fields is None:
            raise InvalidRequestError(f"expected an AsyncRequest, got {type(request).__name__}")
        request = AsyncRequest(**{k: v for k, v in fields().items() if k in AsyncRequest._fields})
    if request.async_fn is not None and not callable(request.async_fn):
        raise InvalidRequestError(
            f"AsyncRequest.async_fn must be callable or None, got {request.async_fn!r}"
        )
    if not isinstance(request.async_fn_args, (tuple, list)):
        raise InvalidRequestError(
            "AsyncRequest.async_fn_args must be a tuple of positional arguments, got "
            f"{type(request.async_fn_args).__name__}"
        )
    if request.async_fn_kwargs is not None and not isinstance(request.async_fn_kwargs, dict):
        raise InvalidRequestError(
            "AsyncRequest.async_fn_kwargs must be a dict or None, got "
            f"{type(request.async_fn_kwargs).__name__}"
        )
    if not isinstance(request.finalize_fns, (list, tuple)) or not all(
        callable(f) for f in request.finalize_fns
    ):
        raise InvalidRequestError("AsyncRequest.finalize_fns must be a list of callables")
    if request.preload_fn is not None:
        if not callable(request.preload_fn):
            raise InvalidRequestError(
                f"AsyncRequest.preload_fn must be callable or None, got {request.preload_fn!r}"
            )
        if len(request.async_fn_args) < 2:
            raise InvalidRequestError(
                "AsyncRequest.preload_fn's result replaces async_fn_args[1], but async_fn_args "
                f"has only {len(request.async_fn_args)} element(s)"
            )
    return request


class State(enum.IntEnum):
    RUNNING = 0
    DONE = 1
    FAILED = 2


@dataclass(frozen=True)
class RankRecord:
    rank: int
    state: State
    call_idx: int
    deadline_passed: bool


def exchange(
    state: State,
    call_idx: int,
    deadline_passed: bool,
    collective_timeout: float,
    *,
    error: BaseException | None = None,
    local_only: bool = False,
    details: dict[str, Any] | None = None,
) -> list[RankRecord]:
    """Every rank's record, in rank order (only this rank's with ``local_only`` or when not
    distributed). Raises the agreed error on every rank when any rank set ``error``.
    """
    outcomes = _dist.agree(
        f"async request {call_idx}",
        error,
        ints=(int(state), int(call_idx), int(deadline_passed)),
        local_only=local_only or not _dist.is_distributed(),
        timeout=collective_timeout,
        details=details,
    )
    return [RankRecord(o.rank, State(o.ints[0]), o.ints[1], bool(o.ints[2])) for o in outcomes]


@dataclass(frozen=True)
class LocalStatus:
    state: State
    error: BaseException | None = None
    timings: dict[str, float] = field(default_factory=dict)


RUNNING = LocalStatus(State.RUNNING)


def exit_description(exitcode: int | None) -> str:
    if exitcode is None:
        return "no exit code"
    if exitcode < 0:
        try:
            return f"exit code {exitcode} (killed by {signal.Signals(-exitcode).name})"
        except ValueError:
            return f"exit code {exitcode}"
    return f"exit code {exitcode}"


def failure_error(rank: int, call_idx: int, failure: RemoteFailure) -> AsyncCallFailedError:
    err = AsyncCallFailedError(
        f"rank {rank}: async request {call_idx} failed in the background: "
        f"{failure.exc_type}: {failure.message}",
        call_idx=call_idx,
        failed_ranks=(rank,),
    )
    err.__cause__ = RemoteTraceback(failure.traceback)
    return err


class AsyncCaller(ABC):
    """Runs requests in the background for one rank; see the module docstring."""

    def __init__(self, timeouts: Timeouts | None = None) -> None:
        self.timeouts = timeouts or default_timeouts()
        self.rank: int | None = None
        self.start_time: float | None = None
        self._unfinalized: list[int] = []

    @abstractmethod
    def schedule_async_call(self, async_req: AsyncRequest) -> None: ...

    @abstractmethod
    def local_status(self, call_idx: int) -> LocalStatus: ...

    @abstractmethod
    def wait_local(self, call_idx: int, timeout: float) -> LocalStatus: ...

    @abstractmethod
    def close(self, abort: bool = False) -> list[int]: ...

    def reports_of(self, call_idx: int) -> _reports.Reports | None:
        """Where the reports of ``call_idx`` arrive (None: it posts none here)."""
        return None

    def forget(self, call_idx: int) -> None:
        """The queue finalized (or gave up on) ``call_idx``."""
        if call_idx in self._unfinalized:
            self._unfinalized.remove(call_idx)

    def is_current_async_call_done(
        self, blocking: bool = False, no_dist: bool = False, finalize_timeout: float | None = None
    ) -> bool:
        """NVRx-compatible check of the oldest unfinalized call on all ranks.

        ``finalize_timeout`` bounds a blocking wait: past it the call is reported as still
        running (False) instead of raising, so a caller such as a shutdown path can go on
        to stop the worker. Without it a blocking wait past ``timeouts.finalize`` raises.
        """
        if not self._unfinalized:
            return True
        call_idx = self._unfinalized[0]
        timeouts = self.timeouts
        if blocking and finalize_timeout is not None:
            if finalize_timeout <= 0:
                raise InvalidRequestError(
                    f"finalize_timeout must be a positive number of seconds, got "
                    f"{finalize_timeout!r}"
                )
            timeouts = replace(self.timeouts, finalize=float(finalize_timeout))
        try:
            done = agree_on_call(self, call_idx, blocking, no_dist, timeouts)
        except CheckpointTimeoutError:
            if finalize_timeout is None:
                raise
            logger.warning(
                "async request %d not done within finalize_timeout=%.1fs",
                call_idx,
                timeouts.finalize,
            )
            return False
        if done:
            self.forget(call_idx)
        return done

    def _debug_is_async_process_running(self) -> bool:
        """Whether the background process is alive (NVRx name; tests check that an abort stopped
        it).
        """
        process = getattr(self, "process", None)
        return process is not None and process.is_alive()

    def sync_all_async_calls(self, is_alive: int) -> bool:
        """NVRx-compatible: True when no rank reports a live call (gloo, library group)."""
        records = exchange(
            State.RUNNING if is_alive else State.DONE, 0, False, self.timeouts.collective
        )
        return all(r.state != State.RUNNING for r in records)

    def _log_dropped_failure(self, call_idx: int, status: LocalStatus) -> None:
        """Say so when ``close`` discards the error of a call nobody finalized."""
        if status.state == State.FAILED and call_idx in self._unfinalized:
            logger.warning(
                "closing the caller drops the error of unfinalized async request %d: %s",
                call_idx,
                status.error,
            )

    def __del__(self) -> None:
        try:
            self.close(abort=True)
        except Exception as exc:  # garbage collection must not raise; say what was lost
            logger.warning("could not stop the background process of a discarded caller: %s", exc)


def is_agreed(exc: BaseException) -> bool:
    """Whether ``exc`` is an agreement's verdict, raised on every rank alike (without loading
    :mod:`resilient_ckpt._rank_errors`, which pulls in ``torch.distributed.checkpoint``)."""
    rank_errors = sys.modules.get("resilient_ckpt._rank_errors")
    return rank_errors is not None and isinstance(exc, rank_errors.RankFailureError)


def staging_error(exc: Exception, request: AsyncRequest) -> Exception:
    """What ``schedule_async_request`` raises when ``request`` could not be staged: where a
    value of the request does not pickle, an :class:`InvalidRequestError` naming the rank,
    the value's path in the request and its type; else ours as it is, or a
    :class:`StagingError` naming the rank and the request; chained to the cause."""
    if isinstance(exc, CheckpointingException) and not isinstance(exc, InvalidRequestError):
        return exc
    preload_fn: Any = request.preload_fn
    if isinstance(preload_fn, PlanStep):  # never pickled: the request is staged as planned
        preload_fn = preload_fn.items
    where = describe_unpicklable(
        {
            "async_fn": request.async_fn,
            "async_fn_args": request.async_fn_args,
            "async_fn_kwargs": request.async_fn_kwargs,
            "preload_fn": preload_fn,
        },
        "request",
    )
    if where is None:
        if isinstance(exc, CheckpointingException):
            return exc
        staging = StagingError(
            f"rank {_dist.rank()}: async request {request.call_idx} could not be staged: "
            f"{type(exc).__name__}: {exc}"
        )
        staging.__cause__ = exc
        return staging
    cause = exc.__cause__ if isinstance(exc, InvalidRequestError) and exc.__cause__ else exc
    error = InvalidRequestError(
        f"rank {_dist.rank()}: async request {request.call_idx} cannot be staged: {where} "
        f"cannot be pickled ({type(cause).__name__}: {cause}). Every value of a request "
        "that is not a tensor must be picklable (no lambdas, local functions, open files or "
        "locks; module-level functions or functools.partial of them)"
    )
    error.__cause__ = exc
    return error


class FailedCall(AsyncCaller):
    """A call that failed before it reached a worker (while it was staged): settled at once,
    so that finalizing it meets the other ranks in the same agreement as any other call, and
    raises there on every rank, instead of this rank skipping the collective they are in."""

    def __init__(self, call_idx: int, error: BaseException) -> None:
        super().__init__()
        named = f"rank {_dist.rank()}: async request {call_idx}"
        text = str(error)
        failure = AsyncCallFailedError(
            text if text.startswith(named) else f"{named} failed while it was staged: {text}",
            call_idx=call_idx,
            failed_ranks=(_dist.rank(),),
        )
        failure.__cause__ = error
        self.status = LocalStatus(State.FAILED, failure)

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        raise InvalidRequestError("a failed call cannot schedule requests")

    def local_status(self, call_idx: int) -> LocalStatus:
        return self.status

    def wait_local(self, call_idx: int, timeout: float) -> LocalStatus:
        return self.status

    def close(self, abort: bool = False) -> list[int]:
        return []


def agree_on_call(
    caller: AsyncCaller, call_idx: int, blocking: bool, no_dist: bool, timeouts: Timeouts
) -> bool:
    """Decide, identically on every rank, whether ``call_idx`` is done everywhere.

    Returns True when it succeeded on all ranks, False when some rank is still writing and
    ``blocking`` is False. Raises on every rank when any rank failed (a
    ``RankAsyncCallFailedError`` or, when a worker died, ``RankWorkerDiedError``: still
    ``AsyncCallFailedError`` / ``WorkerDiedError``), when the ranks are on different calls,
    or when a blocking wait passes ``timeouts.finalize``.
    """
    deadline = time.monotonic() + timeouts.finalize
    # A blocking round first waits for this rank's own call, so a save that ends in time takes
    # one agreement. Across ranks the wait is at most half the collective deadline: the ranks
    # already in the agreement never wait in it past that deadline.
    longest = timeouts.finalize if no_dist else timeouts.collective / 2
    while True:
        if blocking:
            wait = max(0.0, min(deadline - time.monotonic(), longest))
            status = caller.wait_local(call_idx, wait)
        else:
            status = caller.local_status(call_idx)
        passed = blocking and time.monotonic() >= deadline
        records = exchange(
            status.state,
            call_idx,
            passed,
            timeouts.collective,
            error=_failure_of(status, call_idx),
            local_only=no_dist,
            details={"call_idx": call_idx},
        )
        idxs = {r.call_idx for r in records}
        if len(idxs) > 1:
            raise InvalidRequestError(
                f"ranks disagree on the async call being finalized: "
                f"{ {r.rank: r.call_idx for r in records} }; every rank must schedule and "
                "finalize the same requests in the same order"
            )
        if all(r.state == State.DONE for r in records):
            return True
        if not blocking:
            return False
        if any(r.deadline_passed for r in records):
            running = [r.rank for r in records if r.state == State.RUNNING]
            raise CheckpointTimeoutError(
                f"async request {call_idx} still running on rank(s) {running} after "
                f"{timeouts.finalize:.1f}s (RESILIENT_CKPT_FINALIZE_TIMEOUT); the checkpoint "
                "is abandoned and will not be committed"
            )


def _failure_of(status: LocalStatus, call_idx: int) -> BaseException | None:
    """This rank's error for the agreement (a failed state always carries one)."""
    if status.state != State.FAILED:
        return None
    if status.error is not None:
        return status.error
    return AsyncCallFailedError(
        f"rank {_dist.rank()}: async request {call_idx} failed without an error",
        call_idx=call_idx,
        failed_ranks=(_dist.rank(),),
    )


def _fork_entry(
    conn: Connection, parent_pid: int, call_idx: int, async_fn: Any, args: list, kwargs: dict
) -> None:
    arm_parent_death_signal(parent_pid)
    _reports.set_sink(lambda key, value: conn.send(Report(call_idx, key, value)))
    try:
        async_fn(*args, **kwargs)
    except BaseException as exc:
        try:
            conn.send(RemoteFailure.from_exception(exc))
        finally:
            os._exit(1)
    os._exit(0)


def _read_child(conn: Connection, mailbox: _reports.Mailbox, call_idx: int) -> None:
    """The receiver thread: file what the child sends (its reports, its failure) until the
    pipe closes."""
    try:
        while True:
            message = conn.recv()
            if isinstance(message, Report):
                mailbox.report(call_idx, message.key, message.value)
            elif isinstance(message, RemoteFailure):
                mailbox.outcome(call_idx, message)
    except (EOFError, OSError):
        pass
    except Exception as exc:  # a report the trainer cannot unpickle
        logger.error("could not read the forked checkpoint process's pipe: %r", exc)
    finally:
        conn.close()
        mailbox.close()


class TemporalAsyncCaller(AsyncCaller):
    """Forks one child process per request (NVRx's original, deprecated caller)."""

    def __init__(self, timeouts: Timeouts | None = None) -> None:
        super().__init__(timeouts)
        self.process: Any = None
        self._call_idx: int | None = None
        self._status: LocalStatus | None = None
        self._mailbox = _reports.Mailbox()
        self._receiver: threading.Thread | None = None
        self.preloaded_holder: Any = None
        # What the child reads (function, arguments): kept until the child has finished,
        # since the queue drops its own references at scheduling (pinned host memory freed
        # under a running child would invalidate its pages).
        self._execution: Any = None

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        self.rank = _dist.rank()
        self._call_idx = async_req.call_idx
        self._unfinalized.append(async_req.call_idx)
        if async_req.async_fn is None:
            self._status = LocalStatus(State.DONE)
            self._mailbox.close()
            return
        args = list(async_req.async_fn_args)
        if async_req.preload_fn is not None:
            args[1] = checked_preload(async_req.preload_fn)
            self.preloaded_holder = args[1]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        ctx = mp.get_context("fork")
        reader, writer = ctx.Pipe(duplex=False)
        self.start_time = time.monotonic()
        self._execution = (async_req.async_fn, args, dict(async_req.async_fn_kwargs or {}))
        self.process = ctx.Process(
            target=_fork_entry,
            args=(writer, os.getpid(), async_req.call_idx, *self._execution),
            name=f"resilient_ckpt-fork-{self.rank}-{async_req.call_idx}",
        )
        self.process.start()
        writer.close()
        self._receiver = threading.Thread(
            target=_read_child,
            args=(reader, self._mailbox, async_req.call_idx),
            name=f"resilient_ckpt-fork-receiver-{self.rank}-{async_req.call_idx}",
            daemon=True,
        )
        self._receiver.start()

    def reports_of(self, call_idx: int) -> _reports.Reports:
        return self._mailbox.reports_of(call_idx)

    def _settle(self) -> None:
        """Settle the call once the child has exited and its pipe has been read to the end."""
        if self._status is not None or self.process is None:
            return
        if not self._mailbox.closed or self.process.exitcode is None:
            return
        outcomes, _ = self._mailbox.take_outcomes()
        failure = outcomes[-1] if outcomes else None
        code = self.process.exitcode
        self.process.join()
        rank = self.rank if self.rank is not None else 0
        idx = self._call_idx if self._call_idx is not None else -1
        if isinstance(failure, RemoteFailure):
            self._status = LocalStatus(State.FAILED, failure_error(rank, idx, failure))
        elif code != 0:
            self._status = LocalStatus(
                State.FAILED,
                WorkerDiedError(
                    f"rank {rank}: forked checkpoint process (pid {self.process.pid}) for async "
                    f"request {idx} ended with {exit_description(code)}",
                    exitcode=code,
                    call_idx=idx,
                    failed_ranks=(rank,),
                ),
            )
        else:
            self._status = LocalStatus(
                State.DONE,
                None,
                {"write": time.monotonic() - (self.start_time or time.monotonic())},
            )
        self.preloaded_holder = None
        self._execution = None

    def local_status(self, call_idx: int) -> LocalStatus:
        self._settle()
        return self._status or RUNNING

    def wait_local(self, call_idx: int, timeout: float) -> LocalStatus:
        deadline = time.monotonic() + timeout
        while self._status is None and self.process is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            if self._mailbox.wait_closed(remaining):  # the child is exiting or gone
                self.process.join(max(0.0, deadline - time.monotonic()))
            self._settle()
        return self.local_status(call_idx)

    def close(self, abort: bool = False) -> list[int]:
        dropped: list[int] = []
        if self.process is not None and self.process.exitcode is not None:
            if self._call_idx is not None:
                self._log_dropped_failure(self._call_idx, self.local_status(self._call_idx))
        elif self.process is not None:
            if abort:
                dropped = [self._call_idx] if self._call_idx is not None else []
                self.process.kill()
            self.process.join(self.timeouts.shutdown if abort else self.timeouts.finalize)
            if self.process.exitcode is None:
                logger.warning(
                    "forked checkpoint process %s did not finish; killing it", self.process.pid
                )
                self.process.kill()
                self.process.join(self.timeouts.shutdown)
        receiver, self._receiver = self._receiver, None
        if receiver is not None:
            # The child is gone: its end of the pipe closed, so the thread reads EOF.
            receiver.join(self.timeouts.shutdown)
        if self.process is None or self.process.exitcode is not None:
            self.preloaded_holder = None
            self._execution = None
        return dropped
