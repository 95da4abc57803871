"""The steady-state fast path of a local save: reuse the previous shard layout.

Decision: :func:`._format.plan_shard` pops every tensor of the state, records where each
tensor's bytes go, pickles the hollow state with those records as the shard header, and puts
the tensors back: work per tensor, repeated identically while a job saves the same structure.
For a :class:`BasicTensorAwareStateDict` made of plain containers, plain tensors and exact
leaves (``Structure.plain``), the layout is kept under the state's structure key
(:mod:`..async_ckpt._structure`): equal keys mean identical records, so they are reused with
the *current* tensors, whose bytes are read when the request is staged.

The header holds the plain leaves' values too (floats compared by their bits: ``0.0`` and
``-0.0`` pickle apart). A training state's values change at every save (the iteration, the
learning rate), so then only the header is made again, without popping: the hollow state is
built beside the live one (new containers holding the placeholders the tensors would have
left, made once when the layout was cached) and pickled with the records. The records, and
every part of the state that holds only tensors, travel as their cached pickle
(:mod:`._pickled`), as in a full planning: the bytes are exactly those of a full planning.
The layout is cached only if the walk met exactly the tensors ``pop_tensors`` popped, in
order (checked object by object), and only for states whose tensors are on their home
devices.
"""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..async_ckpt._staging import TensorBatch
from ..async_ckpt._structure import PLAIN_TENSOR_TYPES, Structure, StructureCache, walk
from ._format import RecordMemo, ShardLayout, align, header_of
from ._pickled import PickledOnce, PickledValue, constant_size, rebuild, shell_of
from .basic_state_dict import BasicTensorAwareStateDict, TensorPlaceholder

# plan_shard: a full planning, reusing the records of the last one where it can.
PlanFull = Callable[[Any, RecordMemo], ShardLayout]


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


@dataclass(frozen=True)
class _Cached:
    """A full planning's layout (without tensors), for states of its structure."""

    layout: ShardLayout
    values: list  # the plain leaves' values the layout's header holds
    placeholders: list[TensorPlaceholder]


class ShardPlanCache:
    """One manager's memory of its previous shard layout (see the module docstring).

    ``hits``: saves that reused the layout; ``refreshes``: those of them whose header was
    made again for new plain values; ``misses``: saves planned in full.
    """

    def __init__(self) -> None:
        self._structures: StructureCache[_Cached] = StructureCache()
        # The last full planning's records, splices and tensor check (reused by states
        # planned in full; the cached layout, which that planning made, is checked and its
        # header refreshed with them).
        self._records = RecordMemo()
        self.hits = 0
        self.refreshes = 0
        self.misses = 0

    def plan(self, state: Any, plan_full: PlanFull) -> ShardLayout:
        """``plan_full(state)`` or, for a state of the last structure, the cached layout
        with the current tensors (and, if its plain values changed, a new header)."""
        structure = None
        if type(state) is BasicTensorAwareStateDict and state.reusable_layout():
            structure = walk(state.state_dict)
            if structure is not None and not structure.plain:
                structure = None
        cached = None
        if structure is not None:
            cached = self._structures.lookup(structure.key, structure.tensors)
        if structure is None or cached is None:
            return self._plan_full(state, plan_full, structure)
        layout = cached.layout
        if structure.values != cached.values:
            body = hollow_body(state, cached.placeholders, self._records.splices, layout.records)
            if body is None:
                return self._plan_full(state, plan_full, structure)
            header = header_of(body)
            start = align(len(header))
            data_bytes = layout.size - layout.data_start
            layout = ShardLayout(header, [], layout.records, start, start + data_bytes)
            self._structures.keep_product(_Cached(layout, structure.values, cached.placeholders))
            self.refreshes += 1
        self.hits += 1
        tensors = TensorBatch(structure.tensors)
        return ShardLayout(layout.header, tensors, layout.records, layout.data_start, layout.size)

    def _plan_full(
        self, state: Any, plan_full: PlanFull, structure: Structure | None
    ) -> ShardLayout:
        layout = plan_full(state, self._records)
        self.misses += 1
        self._structures.clear()
        if structure is None or not isinstance(layout.records, PickledOnce):
            return layout
        tensors = structure.tensors
        if len(tensors) != len(layout.tensors) or any(
            a is not b for a, b in zip(tensors, layout.tensors, strict=True)
        ):
            return layout
        hollow = ShardLayout(layout.header, [], layout.records, layout.data_start, layout.size)
        placeholders = list(map(TensorPlaceholder.of, tensors))
        self._structures.remember(
            structure.key, tensors, _Cached(hollow, structure.values, placeholders)
        )
        return layout
