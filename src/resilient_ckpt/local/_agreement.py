"""Run a local-checkpoint step that may fail on some ranks, with one outcome on every rank.

Every step that precedes a collective (preparing a save, writing, reading the copies a rank
must send) runs here and agrees its outcome through :func:`resilient_ckpt._dist.agree`, so a
rank that fails alone makes every rank raise the cause instead of leaving its peers waiting
in the next collective until the deadline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from .. import _dist

T = TypeVar("T")


def gather(obj: Any) -> list[Any]:
    """``obj`` from every rank, in rank order (the library's gloo group)."""
    return _dist.all_gather_object(obj)


def _attempt(step: Callable[[], T]) -> tuple[T | None, Exception | None]:
    """``step()`` here: its value, or the exception the agreement carries to every rank."""
    try:
        return step(), None
    except Exception as exc:
        return None, exc


def agree_gather(what: str, step: Callable[[], tuple[T, Any]]) -> tuple[T, list[Any]]:
    """Run ``step`` (returning ``(local, shared)``) here; return ``local`` and every rank's
    ``shared``. Raises on every rank if ``step`` failed on any. Collective.
    """
    result, error = _attempt(step)
    value, shared = result if result is not None else (None, None)
    outcomes = _dist.agree(what, error, payload=shared, with_payload=True)
    return value, [o.payload for o in outcomes]  # type: ignore[return-value]


def agree_number(
    what: str, step: Callable[[], T], number: int, group: Any = None
) -> tuple[T, list[int]]:
    """:func:`agree_gather` of one ``int``, carried in the tensor all-gather of the failure
    flags (no object all-gather, no pickle). Collective on ``group`` (default: the library
    group; a deferred save's staging passes the background group)."""
    value, error = _attempt(step)
    shared = number if error is None and isinstance(number, int) else -1
    outcomes = _dist.agree(what, error, ints=(shared,), group=group)
    return value, [o.ints[0] for o in outcomes]  # type: ignore[return-value]


def agree(what: str, step: Callable[[], T]) -> T:
    """Run ``step`` here; raise on every rank if it failed on any. Collective."""
    value, error = _attempt(step)
    _dist.agree(what, error)
    return value  # type: ignore[return-value]
