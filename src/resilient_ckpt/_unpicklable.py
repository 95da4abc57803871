"""Which value of a state pickle refuses: the key path and the type, for an error message.

Decision: pickling errors name the object's class at best ("Can't pickle local object
'main.<locals>.<lambda>'"), never where it sits in a state of thousands of entries. Every
flow reports a failed pickle the same way: it catches the error, then walks the state it
tried to pickle and tries the non-container values one by one. That walk runs only after a
failure, so a save pays nothing for it; containers are descended rather than pickled whole,
so no value is pickled twice, and tensors are skipped (they are staged, not pickled).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator, Mapping
from typing import Any

import torch

# A walk stops after this many values: a message is not worth minutes on a huge state.
_MAX_VALUES = 100_000


def _children(obj: Any) -> Iterator[tuple[str, Any]] | None:
    """``(path step, child)`` of a container pickle would descend into; None for a leaf."""
    if isinstance(obj, Mapping):
        return ((f"[{key!r}]", value) for key, value in list(obj.items()))
    if isinstance(obj, (list, tuple)):
        return ((f"[{i}]", value) for i, value in enumerate(obj))
    if type(obj).__module__.startswith("resilient_ckpt."):
        # Our own wrappers (a batched state, a request's pieces): their fields, unnamed.
        names = getattr(type(obj), "__slots__", None) or list(getattr(obj, "__dict__", ()))
        return (("", getattr(obj, name)) for name in names if hasattr(obj, name))
    return None


def find_unpicklable(obj: Any, root: str = "") -> tuple[str, type] | None:
    """The path (``root['a'][0]``) and type of the first value in ``obj`` that cannot be
    pickled, or None when every value tried pickles (or the walk's budget ran out)."""
    stack: list[tuple[str, Any]] = [(root, obj)]
    seen: set[int] = set()
    visited = 0
    while stack and visited < _MAX_VALUES:
        path, value = stack.pop()
        visited += 1
        if isinstance(value, torch.Tensor) or id(value) in seen:
            continue
        seen.add(id(value))
        children = _children(value)
        if children is None:
            try:
                pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception:
                return path, type(value)
            continue
        stack.extend(reversed([(path + step, child) for step, child in children]))
    return None


def describe_unpicklable(obj: Any, root: str = "state") -> str | None:
    """``"state['hook'] (a function)"`` for the first value pickle refuses, else None."""
    found = find_unpicklable(obj, root)
    if found is None:
        return None
    path, kind = found
    return f"{path or root} (a {kind.__qualname__})"
