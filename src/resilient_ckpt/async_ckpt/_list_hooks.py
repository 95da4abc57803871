"""``list`` subclasses whose methods do something first: one mechanism for two of them.

A deferred DCP bucket (``_dcp_buckets.ItemTensors``) resolves its tensors before any list
operation; an ``EncodedResults`` (``_encoded_results``) drops its pickled bytes before any
operation that changes it. Both wrap the inherited ``list`` methods with a call of their
own, made here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any


def call_first(cls: type, names: Iterable[str], hook: Callable[[Any], None]) -> None:
    """Make each ``list`` method of ``names`` on ``cls`` call ``hook(self)`` first."""
    for name in names:
        setattr(cls, name, _wrapped(getattr(list, name), hook))


def _wrapped(method: Callable[..., Any], hook: Callable[[Any], None]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        hook(self)
        return method(self, *args, **kwargs)

    return wrapper
