"""Parts of a shard header pickled once and copied into every later header.

Decision: a shard header is the pickle of the hollow state and the tensor records (see
:mod:`._format`). A job saves the same structure again and again, and most of that pickle
is then the same every time: the records, and every dict whose values are all tensors (a
model's ``state_dict()``, an optimizer state's parameter dict), which the hollow state holds
as dicts of placeholders. Pickling them costs ~0.7 us per tensor, each save. So each travels
as ``pickle.loads(payload)``, the payload made once: :class:`PickledOnce` for the records
(a list), :class:`PickledDict` for a dict of placeholders. Loading gets plain lists and dicts
as before (a header is an ordinary pickle: no custom unpickler, and headers written without
these load as they always did).

A full planning (``plan_shard``) and a header refresh of the steady state (:mod:`._shard_cache`)
splice exactly the same dicts, so the two write byte-identical headers: those of
:func:`splice_placeholder_dicts`, the non-empty ``dict``/``OrderedDict`` values whose values
are all placeholders, in a state made only of such containers, lists, tuples and plain
values. Any other object in the state (a custom class that might hold a reference to one of
those dicts, whose sharing the splice would break) leaves the state pickled as it is.

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


class PickledOnce(list):
    """A list that is never changed, pickled once, at creation: it travels pickled as
    ``pickle.loads(payload)`` and unpickles as a plain ``list``. The tensor records of a
    shard: in its header and in every save's request."""

    def __init__(self, items: Any) -> None:
        super().__init__(items)
        self._payload = pickle.dumps(list(self), protocol=pickle.HIGHEST_PROTOCOL)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return pickle.loads, (self._payload,)


class PickledDict:
    """A dict of placeholders, pickled at creation; unpickles as that dict (its type and,
    for an ``OrderedDict``, its attributes included)."""

    __slots__ = ("payload",)

    def __init__(self, mapping: dict) -> None:
        self.payload = pickle.dumps(mapping, protocol=pickle.HIGHEST_PROTOCOL)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return pickle.loads, (self.payload,)


def shell_of(state: BasicTensorAwareStateDict, **attributes: Any) -> BasicTensorAwareStateDict:
    """A new object that pickles as ``state`` with ``attributes`` replaced (the same
    attributes in the same order: a header's bytes do not depend on which was pickled)."""
    shell = BasicTensorAwareStateDict.__new__(BasicTensorAwareStateDict)
    shell.__dict__.update(state.__dict__)
    shell.__dict__.update(attributes)
    return shell


def spliced(state: Any) -> Any:
    """What ``plan_shard`` pickles for a popped ``state``: for a
    ``BasicTensorAwareStateDict`` a shell whose placeholder dicts are :class:`PickledDict`,
    else (or if its contents are not all spliceable) ``state`` itself."""
    if type(state) is not BasicTensorAwareStateDict:
        return state
    tree = splice_placeholder_dicts(state.state_dict)
    return state if tree is None else shell_of(state, state_dict=tree)


def is_placeholder_dict(obj: Any) -> bool:
    """Whether ``obj`` is spliced: a non-empty exact ``dict`` or ``OrderedDict`` of
    placeholders."""
    kind = type(obj)
    return (kind is dict or kind is OrderedDict) and set(map(type, obj.values())) == {
        TensorPlaceholder
    }


class _Opaque(Exception):
    """The state holds an object the splice does not look into."""


def rebuild(
    obj: Any,
    leaf: Callable[[Any], Any],
    whole: Callable[[dict], Any],
    memo: dict[int, Any],
) -> Any:
    """``obj``'s nested dicts, lists and tuples rebuilt beside it, as ``pop_tensors``
    leaves them and a header pickles them: a dict for which ``whole`` returns something
    other than None is replaced by that, every other leaf by ``leaf(value)``. Dicts and
    lists shared by identity stay shared (``memo``: ``pop_tensors`` rewrites them in
    place), tuples are rebuilt at each visit (as there)."""
    kind = type(obj)
    if kind is dict or kind is OrderedDict or kind is list:
        known = memo.get(id(obj))
        if known is not None:
            return known
        out: Any = None
        if kind is list:
            out = [rebuild(value, leaf, whole, memo) for value in obj]
        else:
            out = whole(obj)
        if out is None:
            out = kind((key, rebuild(value, leaf, whole, memo)) for key, value in obj.items())
            if kind is OrderedDict:
                out.__dict__.update(vars(obj))
        memo[id(obj)] = out
        return out
    if kind is tuple:
        return tuple(rebuild(value, leaf, whole, memo) for value in obj)
    return leaf(obj)


def _plain(value: Any) -> Any:
    if type(value) not in _PLAIN:
        raise _Opaque(type(value).__name__)
    return value


def _pickled_once(mapping: dict) -> PickledDict | None:
    return PickledDict(mapping) if is_placeholder_dict(mapping) else None


def splice_placeholder_dicts(obj: Any) -> Any:
    """``obj`` (a hollow state's contents) rebuilt beside it with every placeholder dict as
    a :class:`PickledDict`; None if it holds any object but those of ``_PLAIN``."""
    try:
        return rebuild(obj, _plain, _pickled_once, {})
    except _Opaque:
        return None
