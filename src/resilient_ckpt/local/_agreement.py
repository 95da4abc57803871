"""Turn a step that may fail on some ranks into one outcome on every rank.

Every local-checkpoint step that precedes a collective (preparing a save, writing, reading
the copies a rank must send) runs through :func:`agree`: the step runs locally, its outcome
(a value or an error message) is all-gathered on the library's gloo group, and if any rank
failed, *every* rank raises an error naming the failed ranks and their messages. Without
this, a rank that fails alone leaves its peers waiting in the next collective until the
collective deadline, and they would report a timeout instead of the cause.

The error class raised is the failing rank's when it is one of the library's
message-constructible classes (so ``ConfigurationError`` stays a ``ValueError`` on every
rank), else :class:`~resilient_ckpt.errors.CheckpointingException`; the failing rank
chains its original exception.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ..async_ckpt._completion import gather_objects
from ..config import default_timeouts
from ..errors import (
    CheckpointingException,
    ConfigurationError,
    CorruptCheckpointError,
    StorageError,
)

T = TypeVar("T")

_CLASSES: dict[str, type[CheckpointingException]] = {
    cls.__name__: cls for cls in (ConfigurationError, StorageError, CorruptCheckpointError)
}


def _class_name(exc: BaseException) -> str:
    if isinstance(exc, OSError) and not isinstance(exc, CheckpointingException):
        return StorageError.__name__
    return type(exc).__name__


def gather(obj: Any) -> list[Any]:
    """``obj`` from every rank, in rank order (the library's gloo group)."""
    return gather_objects(obj, default_timeouts().collective)


def _describe(failed: list[tuple[int, Any]]) -> str:
    """The failure messages, each once, with the ranks that reported it."""
    by_message: dict[str, list[int]] = {}
    for rank, (_, message) in failed:
        by_message.setdefault(message, []).append(rank)
    if len(by_message) == 1:
        return next(iter(by_message))
    return "; ".join(f"rank(s) {ranks}: {message}" for message, ranks in by_message.items())


def agree_gather(what: str, step: Callable[[], tuple[T, Any]]) -> tuple[T, list[Any]]:
    """Run ``step`` (returning ``(local, shared)``) here; return ``local`` and every rank's
    ``shared``. Raises on every rank if ``step`` failed on any. Collective.
    """
    error: Exception | None = None
    value: T | None = None
    shared: Any = None
    try:
        value, shared = step()
    except Exception as exc:
        error = exc
    report = None if error is None else (_class_name(error), f"{type(error).__name__}: {error}")
    outcomes: list[Any] = gather((report, shared))
    failed = [(rank, o[0]) for rank, o in enumerate(outcomes) if o[0] is not None]
    if failed:
        ranks = [rank for rank, _ in failed]
        agreed = _CLASSES.get(failed[0][1][0], CheckpointingException)(
            f"{what} failed on rank(s) {ranks}: {_describe(failed)}"
        )
        agreed.failed_ranks = ranks  # type: ignore[attr-defined]
        raise agreed from error
    return value, [o[1] for o in outcomes]  # type: ignore[return-value]


def agree(what: str, step: Callable[[], T]) -> T:
    """Run ``step`` here; raise on every rank if it failed on any. Collective."""
    value, _ = agree_gather(what, lambda: (step(), None))
    return value
