"""The error every rank raises when a step failed on some ranks (see :func:`._dist.agree`).

One type, :class:`RankFailureError`, derives from both our
:class:`~resilient_ckpt.errors.CheckpointingException` and torch's ``CheckpointException``,
so NVRx-style code (``except CheckpointException``, ``.failures``) and ours
(``except CheckpointingException``, ``.failed_ranks``) both catch a failed save. Subclasses
keep the class a caller already catches (:class:`RankConfigurationError` is still a
``ConfigurationError`` and ``ValueError``; :class:`RankWorkerDiedError` a ``WorkerDiedError``).

Pitfall: torch's ``CheckpointException`` is a ``BaseException``. Ours puts ``Exception``
first in the MRO (``RankFailureError -> CheckpointingException -> Exception ->
CheckpointException -> BaseException``), so ``except Exception`` catches it; ``__str__`` is
ours. A module of its own because importing torch's class pulls in DCP and DTensor:
:mod:`resilient_ckpt.errors` hands these names out on first use.
"""

from __future__ import annotations

import pickle
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch.distributed.checkpoint import CheckpointException

from ._exceptions import (
    AsyncCallFailedError,
    CheckpointingException,
    CheckpointReadError,
    ConfigurationError,
    CorruptCheckpointError,
    InvalidRequestError,
    RemoteExceptionError,
    RemoteTraceback,
    StorageError,
    UnsafeCheckpointError,
    WorkerDiedError,
)

__all__ = [
    "RankAsyncCallFailedError",
    "RankCheckpointReadError",
    "RankConfigurationError",
    "RankCorruptCheckpointError",
    "RankFailureError",
    "RankStorageError",
    "RankUnsafeCheckpointError",
    "RankWorkerDiedError",
    "error_class_for",
    "from_checkpoint_exception",
    "is_wrapped_failure",
    "wrap_for_gather",
]


class RankFailureError(CheckpointingException, CheckpointException):
    """A step failed on one or more ranks; raised identically on every rank.

    Attributes:
        what: the step that failed (``"DCP save planning"``, ``"async request 3"``).
        failed_ranks: the ranks that failed, ascending (ranks of the agreeing group).
        tracebacks: each failed rank's traceback text, where the error started (for a
            background worker's error, the worker's traceback).
        failures: torch's view, ``{rank: (exception, StackSummary)}``: this rank's own
            exception where it failed, else a :class:`CheckpointingException` holding the
            remote message, chained to its :class:`~resilient_ckpt.errors.RemoteTraceback`.
    """

    def __init__(
        self,
        message: str,
        *,
        what: str = "",
        failed_ranks: Sequence[int] = (),
        tracebacks: Mapping[int, str] | None = None,
        failures: Mapping[int, Any] | None = None,
    ) -> None:
        # Not CheckpointException.__init__: its (msg, failures) args would become our args
        # and its __str__ our message.
        Exception.__init__(self, message)
        self.message = message
        self.what = what
        self.failed_ranks = tuple(sorted(failed_ranks))
        self.tracebacks = dict(tracebacks or {})
        self._failures = dict(failures) if failures is not None else _remote_failures(self)

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple:
        # Travels between processes (the test launcher, a caller's own gather); the local
        # exception objects in ``failures`` may not pickle, so they are rebuilt from text.
        state = {k: v for k, v in self.__dict__.items() if k != "_failures"}
        return _rebuild, (type(self), self.message), state

    def __setstate__(self, state: dict[str, Any] | None) -> None:
        self.__dict__.update(state or {})
        self._failures = _remote_failures(self)


def _rebuild(cls: type[RankFailureError], message: str) -> RankFailureError:
    return cls(message)


def _remote_failures(error: RankFailureError) -> dict[int, Any]:
    return {
        rank: remote_failure(f"rank {rank} failed in {error.what}", error.tracebacks.get(rank, ""))
        for rank in error.failed_ranks
    }


def remote_failure(message: str, tb: str = "") -> Any:
    """torch's ``(exception, StackSummary)`` pair for a failure known only as text."""
    exc = CheckpointingException(message)
    if tb:
        exc.__cause__ = RemoteTraceback(tb)
    return (exc, traceback.StackSummary())


def is_wrapped_failure(obj: Any) -> bool:
    """Whether ``obj`` is a failure pair as :func:`wrap_for_gather` makes it (what NVRx-style
    writers may return from ``retrieve_write_results`` instead of raising)."""
    return (
        isinstance(obj, tuple)
        and len(obj) == 2
        and isinstance(obj[0], BaseException)
        and isinstance(obj[1], traceback.StackSummary)
    )


def wrap_for_gather(exc: BaseException, wrap: Callable[[BaseException], Any] | None = None) -> Any:
    """``(exception, stack summary)`` as ``wrap`` makes it (default :func:`local_failure`),
    made safe to pickle: ``gather_object`` pickles it on the failing rank, and a pickling
    error there would leave the other ranks waiting in the gather (NVRx's
    ``filesystem_async._wrap_exception_for_gather``). An exception that still does not pickle
    is replaced by a :class:`~resilient_ckpt.errors.RemoteExceptionError` with its type,
    message and traceback text.
    """
    wrapped, stack = (wrap or local_failure)(exc)
    _drop_code_objects(stack)
    try:
        pickle.dumps(stack)
    except Exception:
        stack = traceback.StackSummary.from_list(
            [(f.filename, f.lineno or 0, f.name, f.line) for f in stack]
        )
    try:
        pickle.loads(pickle.dumps(wrapped))
    except Exception as why:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        wrapped = RemoteExceptionError(
            f"{type(exc).__module__}.{type(exc).__qualname__}: {exc} (not picklable: {why!r})",
            exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
            traceback_text=text,
        )
    return wrapped, stack


def local_failure(exc: BaseException) -> Any:
    """torch's ``(exception, StackSummary)`` pair for this rank's own exception."""
    return exc, _drop_code_objects(traceback.extract_tb(exc.__traceback__))


def _drop_code_objects(stack: traceback.StackSummary) -> traceback.StackSummary:
    """``stack`` without its frames' code objects (Python 3.13+ keeps them; they do not
    pickle), in place."""
    for frame in stack:
        if getattr(frame, "_code", None) is not None:
            object.__setattr__(frame, "_code", None)
    return stack


class RankConfigurationError(RankFailureError, ConfigurationError):
    """A bad argument or setting on some ranks (a ``ConfigurationError`` on every rank)."""


class RankInvalidRequestError(RankFailureError, InvalidRequestError):
    """A request that cannot be honoured on some ranks (a value that cannot be pickled, a
    wrong type): an ``InvalidRequestError`` and ``ValueError`` on every rank."""


class RankStorageError(RankFailureError, StorageError):
    """Storage failed on some ranks (a ``StorageError`` and ``OSError`` on every rank)."""


class RankCheckpointReadError(RankStorageError, CheckpointReadError):
    """Some ranks could not read (or verify) a data file a load needed from them; each
    failed rank's message names its file. Also a ``StorageError`` and ``OSError``."""

    rank: int | None = None
    path: str | None = None


class RankCorruptCheckpointError(RankFailureError, CorruptCheckpointError):
    """A checkpoint failed verification on some ranks."""

    path: str | None = None


class RankUnsafeCheckpointError(RankFailureError, UnsafeCheckpointError):
    """A checkpoint file asked for a global that was not allowed, on some ranks (nothing
    was run); ``path`` and ``name`` are those of the first, where known."""

    path: str | None = None
    name: str = ""


class RankAsyncCallFailedError(RankFailureError, AsyncCallFailedError):
    """An async request raised in the background on some ranks."""

    call_idx: int | None = None


class RankWorkerDiedError(RankFailureError, WorkerDiedError):
    """A background worker died on some ranks; ``exitcode`` is the first dead one's."""

    call_idx: int | None = None
    exitcode: int | None = None


_BY_CAUSE: dict[str, type[RankFailureError]] = {
    ConfigurationError.__name__: RankConfigurationError,
    InvalidRequestError.__name__: RankInvalidRequestError,
    CheckpointReadError.__name__: RankCheckpointReadError,
    StorageError.__name__: RankStorageError,
    OSError.__name__: RankStorageError,  # a raw I/O error is a storage failure
    CorruptCheckpointError.__name__: RankCorruptCheckpointError,
    UnsafeCheckpointError.__name__: RankUnsafeCheckpointError,
    AsyncCallFailedError.__name__: RankAsyncCallFailedError,
    WorkerDiedError.__name__: RankWorkerDiedError,
}


def from_checkpoint_exception(what: str, exc: CheckpointException) -> RankFailureError:
    """Ours, for torch's ``CheckpointException`` (raised by torch's own collectives): the
    same ``failures``, plus the failed ranks, their messages and tracebacks."""
    failures = dict(exc.failures)
    ranks = sorted(failures)
    messages = {r: f"{type(e).__name__}: {e}" for r, (e, _) in failures.items()}
    tracebacks = {
        r: "".join(traceback.format_list(trace) if trace is not None else [])
        + "".join(traceback.format_exception_only(type(e), e))
        for r, (e, trace) in failures.items()
    }
    distinct = list(dict.fromkeys(messages[r] for r in ranks))
    described = (
        distinct[0] if len(distinct) == 1 else "; ".join(f"rank {r}: {messages[r]}" for r in ranks)
    )
    cls = error_class_for([[c.__name__ for c in type(failures[r][0]).__mro__] for r in ranks])
    return cls(
        f"{what} failed on rank(s) {ranks}: {described}",
        what=what,
        failed_ranks=ranks,
        tracebacks=tracebacks,
        failures=failures,
    )


def error_class_for(kinds: Sequence[Sequence[str]]) -> type[RankFailureError]:
    """The class every rank raises, from each failed rank's MRO class names (rank order): a
    dead worker outranks everything (other failures are its consequences); else the first
    failed rank's most derived known kind; else the base class."""
    if any(WorkerDiedError.__name__ in names for names in kinds):
        return RankWorkerDiedError
    for name in kinds[0] if kinds else ():
        if name in _BY_CAUSE:
            return _BY_CAUSE[name]
    return RankFailureError
