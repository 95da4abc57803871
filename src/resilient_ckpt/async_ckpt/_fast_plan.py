"""The steady-state check of an async DCP save: is this state laid out as at the last save?

Decision: with the plan cache on, a save of an unchanged structure needs no planning at all,
only the cached plan and the state's current objects. The general check (set up the planner,
which flattens the state, then a BLAKE2b signature over a textual description of every entry,
see :mod:`._structure`) costs ~10 us per entry: most of a 2000-tensor save's stall. This
module checks the same thing in one walk over the *nested* state, ~1 us per entry:

* **tokens**: for every container, its type and its keys in order; for every leaf, its type
  (for a ``list``, its elements' types too: DCP flattens a list element by element only if
  it holds tensors or mappings, as an optimizer's ``param_groups`` does, else keeps it as
  one leaf, so that decides the flattening);
* **plan keys**: for a tensor, what its write items depend on (shape, dtype,
  ``requires_grad``, layout); for a DTensor, its spec (mesh, placements, global shape,
  stride, dtype: compared by identity first, which holds while the DTensor object is the
  same) and ``requires_grad``.

A :class:`FastRecord` is made after a planned save, only if DCP's own flattening of that
state visited exactly the walk's leaves, in order (checked object by object), so the
planner's flat state can later be rebuilt as ``dict(zip(fqns, leaves))`` without flattening.
It also keeps the planning context (planner type and settings, writer type, world size,
ranks), as the signature does. Anything the walk does not model (ShardedTensors, objects
with ``__create_write_items__``, other tensor subclasses, lists of lists, non-default
planners) gets no record: those saves take the general path.

Equal tokens and plan keys imply an equal structure signature, so the cached plan is valid
for this rank; the saver still agrees across ranks (one small collective) that every rank
matched the same planning generation.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from .._torch_compat import DTensor

# What a tensor leaf's write items depend on, by its exact type (the plan keys above).
_PLAN_KEY: dict[type, Any] = {
    DTensor: operator.attrgetter("_spec", "requires_grad"),
    torch.Tensor: operator.attrgetter("shape", "dtype", "requires_grad", "layout"),
    torch.nn.Parameter: operator.attrgetter("shape", "dtype", "requires_grad", "layout"),
}

# A mapping whose values are tensors of one of these types (a model's or an optimizer
# state's parameters, typically), possibly beside plain scalars (leaves whose token is their
# type alone), is walked by C-level ``map`` calls, ~0.2 us per entry instead of ~1: the
# same tokens and keys as the loop in ``_walk``.
_UNIFORM = frozenset(_PLAN_KEY)
_SCALARS = frozenset({int, float, complex, str, bytes, bool, type(None)})


class _Unsupported(Exception):
    """The state holds something the walk does not model."""


def _leaf(value: Any, tokens: list) -> None:
    """The token of a leaf that is neither a mapping, a list nor a tensor of ``_PLAN_KEY``."""
    kind = type(value)
    if isinstance(value, torch.Tensor) or hasattr(value, "__create_write_items__"):
        raise _Unsupported(kind.__name__)
    tokens.append(kind)


def _list(value: list, tokens: list, leaves: list, keys: list) -> None:
    """A list: DCP's flattening keeps it whole as one leaf unless it holds a mapping or a
    tensor (an optimizer's ``param_groups``, say); then it goes element by element."""
    inner = tuple(map(type, value))
    if any(issubclass(t, list) for t in inner):
        raise _Unsupported("list of lists")
    if not any(issubclass(t, (Mapping, torch.Tensor)) for t in inner):
        leaves.append(value)
        tokens.append((list, inner))
        return
    tokens.append((list, len(value)))
    for element, kind in zip(value, inner, strict=True):
        _entry(element, kind, tokens, leaves, keys)


def _entry(value: Any, kind: type, tokens: list, leaves: list, keys: list) -> None:
    """One value of a mapping, or one element of a list DCP flattens element by element."""
    key_of = _PLAN_KEY.get(kind)
    if key_of is not None:
        leaves.append(value)
        tokens.append(kind)
        keys.append(key_of(value))
    elif isinstance(value, Mapping):
        _walk(value, tokens, leaves, keys)
    elif kind is list:
        _list(value, tokens, leaves, keys)
    else:
        leaves.append(value)
        _leaf(value, tokens)


def _walk(mapping: Mapping, tokens: list, leaves: list, keys: list) -> None:
    tokens.append((type(mapping), tuple(mapping)))
    values = list(mapping.values())
    kinds = list(map(type, values))
    distinct = set(kinds)
    tensor_kinds = distinct - _SCALARS
    if not tensor_kinds or (len(tensor_kinds) == 1 and tensor_kinds <= _UNIFORM):
        # Leaves only, of one tensor type at most: tokens are the types, keys the tensors'.
        tokens.extend(kinds)
        leaves.extend(values)
        if tensor_kinds:
            (kind,) = tensor_kinds
            tensors = values if len(distinct) == 1 else [v for v in values if type(v) is kind]
            keys.extend(map(_PLAN_KEY[kind], tensors))
        return
    for value, kind in zip(values, kinds, strict=True):
        _entry(value, kind, tokens, leaves, keys)


def walk(state_dict: Mapping) -> tuple[list, list, list] | None:
    """``(tokens, leaves, plan keys)`` of a nested state, or None if it is not modelled."""
    tokens: list = []
    leaves: list = []
    keys: list = []
    try:
        _walk(state_dict, tokens, leaves, keys)
    except _Unsupported:
        return None
    return tokens, leaves, keys


def planner_supported(planner: Any) -> bool:
    """A planner whose set-up is DCP's flattening, so the fast path may emulate it."""
    return (
        isinstance(planner, DefaultSavePlanner)
        and type(planner).set_up_planner is DefaultSavePlanner.set_up_planner
        and bool(getattr(planner, "flatten_state_dict", False))
        and not getattr(planner, "_enable_plan_caching", False)
    )


@dataclass(frozen=True)
class FastRecord:
    """What a steady-state save compares against, and how to rebuild the flat state."""

    context: tuple
    tokens: list
    keys: list
    fqns: tuple[str, ...]
    mappings: dict
    generation: int

    @classmethod
    def make(
        cls, state_dict: Mapping, planner: Any, context: tuple, generation: int
    ) -> FastRecord | None:
        """After ``planner.set_up_planner(state_dict)``: a record, if the walk matches DCP."""
        if not planner_supported(planner):
            return None
        walked = walk(state_dict)
        flat = getattr(planner, "state_dict", None)
        if walked is None or not isinstance(flat, dict):
            return None
        tokens, leaves, keys = walked
        if len(flat) != len(leaves):
            return None
        if any(a is not b for a, b in zip(flat.values(), leaves, strict=True)):
            return None
        mappings = dict(getattr(planner, "mappings", {}) or {})
        return cls(context, tokens, keys, tuple(flat), mappings, generation)

    def match(self, state_dict: Mapping, context: tuple) -> list | None:
        """The state's leaves (in the flat order) if it is laid out as recorded, else None."""
        if context != self.context:
            return None
        walked = walk(state_dict)
        if walked is None:
            return None
        tokens, leaves, keys = walked
        if tokens != self.tokens or keys != self.keys:
            return None
        return leaves

    def set_up(self, planner: Any, leaves: list, is_coordinator: bool) -> None:
        """What ``DefaultSavePlanner.set_up_planner`` would leave, without flattening."""
        planner.state_dict = dict(zip(self.fqns, leaves, strict=True))
        planner.mappings = dict(self.mappings)
        planner.is_coordinator = is_coordinator


def steady_state_plan(planning: Any, cache: Any) -> Any:
    """The cached central plan if every rank's state matches its record of the same
    planning generation, with the planner and writer set up for it; else None.

    Collective (one small all-gather on a gloo group, see ``_planning.agree``); it also
    carries set-up failures (a bad writer, an unusable directory): any rank's failure
    raises on every rank.
    """
    from .. import _dist
    from ..errors import CheckpointingException
    from ._planning import agreement_group, check_writer

    dw = planning.dist_wrapper
    record: FastRecord | None = cache.fast_record
    leaves: list | None = None
    error: Exception | None = None
    try:
        check_writer(planning.writer)
        if record is not None and planner_supported(planning.planner):
            leaves = record.match(planning.state_dict, planning.context())
            if leaves is not None:
                planning.set_up_writer()
    except Exception as exc:
        error = exc
    outcomes = _dist.agree(
        "DCP save planning (steady-state check)",
        error,
        ints=(leaves is not None, record.generation if record is not None else -1),
        group=agreement_group(dw),
        local_only=not dw.use_dist or dw.get_world_size() == 1,
    )
    if not all(o.ints[0] for o in outcomes) or len({o.ints[1] for o in outcomes}) != 1:
        return None
    if record is None or leaves is None:  # this rank reported a match above
        raise CheckpointingException("steady-state planning: a matched record went missing")
    record.set_up(planning.planner, leaves, dw.is_coordinator)
    planning.is_set_up = True
    return cache.cached_central_plan
