"""Parts of a shard header pickled once and copied into every later header.

Decision: a shard header is the pickle of the hollow state and the tensor records (see
:mod:`._format`). A job saves the same structure again and again, and most of that pickle
is then the same every time: the records, and every part of the state that holds tensors
and nothing else (a model's ``state_dict()``; an optimizer's ``state``, one dict of tensors
per parameter), which the hollow state holds as placeholders. Pickling those costs time per
tensor, each save. So each travels as ``pickle.loads(payload)``, the payload made once:
:class:`PickledOnce` for the records (a list), :class:`PickledValue` for each outermost
*constant* container (non-empty, every value a placeholder or a constant container).
Loading gets the same plain lists and dicts as before (a header is an ordinary pickle: no
custom unpickler, and headers written without these load as they always did).

A full planning (``plan_shard``) and a header refresh of the steady state (:mod:`._shard_cache`)
splice exactly the same containers, so the two write byte-identical headers: those of
:func:`splice_constants`, in a state made only of dicts, ``OrderedDict``s, lists, tuples,
placeholders and plain values. Any other object in the state (a custom class that might
hold a reference to one of those containers, whose sharing the splice would break) leaves
the state pickled as it is, and so does a container met twice inside a constant one.
(Whether a container is constant is decided from the object itself, never from the
previous save's, so a changed sharing between saves cannot misplace a cached pickle.)

Alternative not taken: a pickler whose ``reducer_override`` emits the cached bytes. Pickle
calls it for no exact ``dict``, and splicing raw bytes into a pickle stream would renumber
its memo.
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from .basic_state_dict import BasicTensorAwareStateDict, TensorPlaceholder

_PLAIN = frozenset({int, float, complex, str, bytes, bool, type(None), TensorPlaceholder})
_PLACEHOLDER = frozenset({TensorPlaceholder})
_CONTAINERS = frozenset({dict, OrderedDict, list, tuple})


class PickledOnce(list):
    """A list that is never changed, pickled once, at creation: it travels pickled as
    ``pickle.loads(payload)`` and unpickles as a plain ``list``. The tensor records of a
    shard: in its header and in every save's request."""

    def __init__(self, items: Any) -> None:
        super().__init__(items)
        self._payload = pickle.dumps(list(self), protocol=pickle.HIGHEST_PROTOCOL)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return pickle.loads, (self._payload,)


class PickledValue:
    """A container of ``size`` placeholders, pickled at creation; unpickles as that
    container (its type and, for an ``OrderedDict``, its attributes included)."""

    __slots__ = ("payload", "size")

    def __init__(self, container: Any, size: int) -> None:
        self.payload = pickle.dumps(container, protocol=pickle.HIGHEST_PROTOCOL)
        self.size = size

    def __reduce_ex__(self, protocol: Any) -> Any:
        return pickle.loads, (self.payload,)


def shell_of(state: BasicTensorAwareStateDict, **attributes: Any) -> BasicTensorAwareStateDict:
    """A new object that pickles as ``state`` with ``attributes`` replaced (the same
    attributes in the same order: a header's bytes do not depend on which was pickled)."""
    shell = BasicTensorAwareStateDict.__new__(BasicTensorAwareStateDict)
    shell.__dict__.update(state.__dict__)
    shell.__dict__.update(attributes)
    return shell


def spliced(state: Any) -> tuple[Any, list[PickledValue]]:
    """What ``plan_shard`` pickles for a popped ``state``, and its splices in visiting
    order: for a ``BasicTensorAwareStateDict`` a shell whose constant parts are
    :class:`PickledValue`, else (or if its contents are not all spliceable) ``state``
    itself and none. A header refresh reuses the splices (:mod:`._shard_cache`)."""
    if type(state) is not BasicTensorAwareStateDict:
        return state, []
    made = splice_constants(state.state_dict)
    if made is None:
        return state, []
    tree, splices = made
    return shell_of(state, state_dict=tree), splices


def constant_size(obj: Any, tensor_kinds: frozenset, sizes: dict[int, int | None]) -> int | None:
    """How many tensors (of ``tensor_kinds``: tensors, or the placeholders they leave)
    ``obj`` holds if it is *constant*: a non-empty ``dict``, ``OrderedDict``, ``list`` or
    ``tuple`` whose every value is such a tensor or a constant container; None otherwise.
    ``sizes`` memoizes it by object for one traversal."""
    kind = type(obj)
    if kind not in _CONTAINERS:
        return None
    key = id(obj)
    if key in sizes:
        return sizes[key]
    values = list(obj.values()) if kind is dict or kind is OrderedDict else obj
    kinds = set(map(type, values))
    size: int | None = None
    if not values or not kinds <= tensor_kinds | _CONTAINERS:
        pass
    elif kinds <= tensor_kinds:
        size = len(values)
    else:
        size = 0
        for value in values:
            inner = 1 if type(value) in tensor_kinds else constant_size(value, tensor_kinds, sizes)
            if inner is None:
                size = None
                break
            size += inner
    sizes[key] = size
    return size


class _Opaque(Exception):
    """The state holds an object the splice does not look into."""


def rebuild(
    obj: Any,
    leaf: Callable[[Any], Any],
    whole: Callable[[Any], Any],
    memo: dict[int, Any],
) -> Any:
    """``obj``'s nested dicts, lists and tuples rebuilt beside it, as ``pop_tensors``
    leaves them and a header pickles them: a container for which ``whole`` returns
    something other than None is replaced by that, every other leaf by ``leaf(value)``.
    Dicts and lists shared by identity stay shared (``memo``: ``pop_tensors`` rewrites
    them in place), tuples are rebuilt at each visit (as there)."""
    kind = type(obj)
    if kind is dict or kind is OrderedDict or kind is list:
        known = memo.get(id(obj))
        if known is not None:
            return known
        out: Any = whole(obj)
        if out is None and kind is list:
            out = [rebuild(value, leaf, whole, memo) for value in obj]
        elif out is None:
            out = kind((key, rebuild(value, leaf, whole, memo)) for key, value in obj.items())
            if kind is OrderedDict:
                out.__dict__.update(vars(obj))
        memo[id(obj)] = out
        return out
    if kind is tuple:
        out = whole(obj)
        return tuple(rebuild(v, leaf, whole, memo) for v in obj) if out is None else out
    return leaf(obj)


def _plain(value: Any) -> Any:
    if type(value) not in _PLAIN:
        raise _Opaque(type(value).__name__)
    return value


def _shared(obj: Any, seen: set[int], shared: set[int]) -> None:
    """Ids of the dicts and lists met more than once in ``obj`` into ``shared``."""
    kind = type(obj)
    if kind is dict or kind is OrderedDict or kind is list:
        if id(obj) in seen:
            shared.add(id(obj))
            return
        seen.add(id(obj))
    if kind is dict or kind is OrderedDict:
        obj = obj.values()
    elif kind is not list and kind is not tuple:
        return
    for value in obj:
        _shared(value, seen, shared)


def _holds_any(obj: Any, ids: set[int]) -> bool:
    """Whether a container strictly inside ``obj`` is one of ``ids``."""
    values = obj.values() if isinstance(obj, dict) else obj
    return any(type(v) in _CONTAINERS and (id(v) in ids or _holds_any(v, ids)) for v in values)


def splice_constants(obj: Any) -> tuple[Any, list[PickledValue]] | None:
    """``obj`` (a hollow state's contents) rebuilt beside it with every outermost constant
    container (see :func:`constant_size`) as a :class:`PickledValue`, unless a container
    inside it is also met elsewhere (one pickle would then make two objects of it), and
    those splices in visiting order; None if ``obj`` holds any object but those of
    ``_PLAIN``."""
    seen: set[int] = set()
    shared: set[int] = set()
    _shared(obj, seen, shared)
    sizes: dict[int, int | None] = {}
    splices: list[PickledValue] = []

    def whole(container: Any) -> PickledValue | None:
        size = constant_size(container, _PLACEHOLDER, sizes)
        if size is None or (shared and _holds_any(container, shared)):
            return None
        splices.append(PickledValue(container, size))
        return splices[-1]

    try:
        return rebuild(obj, _plain, whole, {}), splices
    except _Opaque:
        return None
