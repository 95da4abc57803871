"""The steady-state fast path of a local save: reuse the previous shard layout.

Decision: :func:`._format.plan_shard` pops every tensor of the state (a placeholder object
each), records where each tensor's bytes go, pickles the hollow state with those records
as the shard header, and puts the tensors back: work per tensor, repeated identically
while a job saves the same structure. For a :class:`BasicTensorAwareStateDict` (plain nested
dicts, lists and tuples) this cache instead walks the state once (a C-level pass over a dict
of tensors of one type) and compares it with the state the cached layout was
planned from:

* every container's type and keys (dicts, and ``OrderedDict`` such as a module's
  ``state_dict()``, with its attributes) or length (lists, tuples), in order;
* which dicts and lists are met a second time, by identity (a header pickles them once:
  loading gives one object where the state had one);
* for every tensor, what its placeholder and record hold: type, shape, dtype, device,
  layout, ``requires_grad`` (with its stride, see
  :func:`..async_ckpt._stage_cache.tensor_meta`; a changed stride alone just plans again);
* every other leaf's type, when it is one whose equality is exact and whose pickle depends
  only on its value (``int``, ``float``, ``str``, ``bytes``, ``bool``, ``None``); a leaf of
  any other type disables the cache for that state (its pickle is re-made).

Equal walks mean identical records, so the cached ones are reused with the *current*
tensors (their bytes are read when the request is staged). The header is reused as well
when the plain leaves' values are equal too (floats compared bit for bit: ``0.0`` and
``-0.0`` pickle apart). A training state's plain values change at every save (the
iteration, the learning rate), so then only the header is made again, without popping: the
hollow state is built beside the live one (new containers holding the placeholders the
tensors would have left, made once when the layout was cached) and pickled with the records.
The records, and every part of the state that holds only tensors (a model's state_dict, an
optimizer's per-parameter state), travel as their cached pickle (:mod:`._pickled`), as they
do in a full planning: the bytes are exactly those of a full planning, without the per-tensor
work of one. The layout is cached only
if the walk met exactly the tensors ``pop_tensors`` popped, in order (checked object by
object), and only for states whose tensors are on their home devices.
"""

from __future__ import annotations

import itertools
import pickle
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ..async_ckpt._staging import PLAIN_TENSOR_TYPES, TensorBatch
from ._format import RecordMemo, ShardLayout, align, header_of
from ._pickled import PickledOnce, PickledValue, constant_size, rebuild, shell_of
from .basic_state_dict import BasicTensorAwareStateDict, TensorPlaceholder

_EXACT = (int, str, bytes, bool, type(None))
_AGAIN = "again"  # the token of a container met before in the same walk


# plan_shard: a full planning, reusing the records of the last one where it can.
PlanFull = Callable[[Any, RecordMemo], ShardLayout]


class _Unsupported(Exception):
    pass


def _one_tensor_type(items: list) -> bool:
    """Whether ``items`` (a dict's values) are all tensors of one type (a model's
    parameters): then walked, and hollowed, by C-level passes."""
    kinds = set(map(type, items))
    return len(kinds) == 1 and kinds <= PLAIN_TENSOR_TYPES


def _walk(obj: Any, tokens: list, values: list, tensors: list, seen: dict[int, int]) -> None:
    kind = type(obj)
    if kind is dict or kind is OrderedDict or kind is list:
        # Met before (by identity): the header pickles it once, so sharing is structure.
        count = len(seen)
        first = seen.setdefault(id(obj), count)
        if first != count:
            tokens.append((_AGAIN, first))
    if kind is dict or kind is OrderedDict:
        if kind is dict:
            tokens.append((kind, tuple(obj)))
        else:  # a module's state_dict(): its attributes (``_metadata``) pickle with it
            tokens.append((kind, tuple(obj), _attributes(obj)))
        items = list(obj.values())
        if _one_tensor_type(items):
            tensors.extend(items)
            tokens.extend(map(type, items))
            return
        for item in items:
            _walk(item, tokens, values, tensors, seen)
    elif kind is list or kind is tuple:
        tokens.append((kind, len(obj)))
        for item in obj:
            _walk(item, tokens, values, tensors, seen)
    elif kind in PLAIN_TENSOR_TYPES:
        tensors.append(obj)
        tokens.append(kind)
    elif kind is float:
        tokens.append(kind)
        values.append(obj.hex())  # exact: 0.0 == -0.0 but they pickle apart
    elif kind in _EXACT:
        tokens.append(kind)
        values.append((kind, obj))
    else:
        # Subclasses of dict/list/tuple (named tuples), other tensor types, objects whose
        # pickle may not follow their equality: always planned in full.
        raise _Unsupported(kind.__name__)


def _attributes(obj: Any) -> bytes | None:
    """An object's attributes as a comparable snapshot (their pickle), None if it has none."""
    attrs = vars(obj)
    if not attrs:
        return None
    try:
        return pickle.dumps(attrs, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # the full planning reports it, in its words
        raise _Unsupported(f"unpicklable attributes: {exc!r}") from exc


def walk(state: Any) -> tuple[list, list, TensorBatch] | None:
    """``(tokens, values, tensors)`` of ``state``: its structure, its plain leaves' values,
    and the tensors in order, as the batch a shard layout stages them in."""
    tokens: list = []
    values: list = []
    tensors = TensorBatch()
    try:
        _walk(state, tokens, values, tensors, {})
    except _Unsupported:
        return None
    return tokens, values, tensors


class _Mismatch(Exception):
    """The state's tensors do not line up with the cached placeholders and dicts."""


class _Fill:
    """What :func:`_hollow` hands out, in visiting order: the cached placeholders and, for
    each outermost constant container (see :func:`._pickled.constant_size`), the pickle the
    full planning made of it (``plan_shard``'s splices, in the same order)."""

    def __init__(self, placeholders: list, splices: list[PickledValue]) -> None:
        self._placeholders = iter(placeholders)
        self._splices = iter(splices)

    def placeholder(self) -> TensorPlaceholder:
        holder = next(self._placeholders, None)
        if holder is None:
            raise _Mismatch
        return holder

    def constant(self, size: int) -> PickledValue:
        """The splice of the next constant container, which holds ``size`` tensors."""
        if len(list(itertools.islice(self._placeholders, size))) != size:
            raise _Mismatch
        splice = next(self._splices, None)
        if splice is None or splice.size != size:
            raise _Mismatch
        return splice

    def exhausted(self) -> bool:
        return next(self._placeholders, None) is None and next(self._splices, None) is None


def _hollow(obj: Any, fill: _Fill) -> Any:
    """``obj`` as ``pop_tensors`` leaves it and ``plan_shard`` pickles it (see
    :mod:`._pickled`), built beside it: tensors replaced by the next placeholders, constant
    containers by their pickled hollow."""
    sizes: dict[int, int | None] = {}

    def leaf(value: Any) -> Any:
        return fill.placeholder() if type(value) in PLAIN_TENSOR_TYPES else value

    def whole(container: Any) -> PickledValue | None:
        size = constant_size(container, PLAIN_TENSOR_TYPES, sizes)
        return None if size is None else fill.constant(size)

    return rebuild(obj, leaf, whole, {})


def hollow_body(
    state: BasicTensorAwareStateDict,
    placeholders: list,
    splices: list[PickledValue],
    records: list,
) -> bytes | None:
    """The header body ``plan_shard`` would pickle for ``state``, whose tensors would leave
    ``placeholders`` and its constant containers ``splices``, with ``records`` (the cached
    layout's, a ``PickledOnce``; see the module docstring); None where it cannot be made
    so."""
    fill = _Fill(placeholders, splices)
    try:
        hollow = _hollow(state.state_dict, fill)
    except _Mismatch:
        return None
    if not fill.exhausted():
        return None
    shell = shell_of(state, state_dict=hollow, _is_hollow=True, _origin=None)
    try:
        return pickle.dumps((shell, records), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # not picklable: the full planning reports it
        return None


class ShardPlanCache:
    """One manager's memory of its previous shard layout (see the module docstring).

    ``hits``: saves that reused the layout; ``refreshes``: those of them whose header was
    made again for new plain values; ``misses``: saves planned in full.
    """

    def __init__(self) -> None:
        self._tokens: list | None = None
        self._values: list = []
        self._layout: ShardLayout | None = None
        self._placeholders: list[TensorPlaceholder] = []
        # The last full planning's records, splices and tensor check (reused by states
        # planned in full; the cached layout, which that planning made, is checked and its
        # header refreshed with them).
        self._records = RecordMemo()
        self.hits = 0
        self.refreshes = 0
        self.misses = 0

    def plan(self, state: Any, plan_full: PlanFull) -> ShardLayout:
        """``plan_full(state)`` or, for a state laid out as last time, the cached layout
        with the current tensors (and, if its plain values changed, a new header)."""
        walked = None
        if type(state) is BasicTensorAwareStateDict and state.reusable_layout():
            walked = walk(state.state_dict)
        cached = self._layout
        if (
            walked is None
            or cached is None
            or walked[0] != self._tokens
            or not self._records.matches(walked[2])
        ):
            return self._plan_full(state, plan_full, walked)
        _, values, tensors = walked
        if values != self._values:
            body = hollow_body(state, self._placeholders, self._records.splices, cached.records)
            if body is None:
                return self._plan_full(state, plan_full, walked)
            header = header_of(body)
            start = align(len(header))
            data_bytes = cached.size - cached.data_start
            cached = ShardLayout(header, [], cached.records, start, start + data_bytes)
            self._layout, self._values = cached, values
            self.refreshes += 1
        self.hits += 1
        return ShardLayout(cached.header, tensors, cached.records, cached.data_start, cached.size)

    def _plan_full(self, state: Any, plan_full: PlanFull, walked: Any) -> ShardLayout:
        layout = plan_full(state, self._records)
        self.misses += 1
        self._tokens, self._layout, self._placeholders = None, None, []
        if walked is None or not isinstance(layout.records, PickledOnce):
            return layout
        tokens, values, tensors = walked
        if len(tensors) != len(layout.tensors) or any(
            a is not b for a, b in zip(tensors, layout.tensors, strict=True)
        ):
            return layout
        self._tokens, self._values = tokens, values
        self._layout = ShardLayout(
            layout.header, [], layout.records, layout.data_start, layout.size
        )
        self._placeholders = list(map(TensorPlaceholder.of, tensors))
        return layout
