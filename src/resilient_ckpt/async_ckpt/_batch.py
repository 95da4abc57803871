"""Groups of tensors that staging describes in one reducer call (see :mod:`._staging`).

Decision: per tensor, a reducer call and a descriptor pickled on its own cost ~1.5 us when
the tensors are cache-cold after a training step: a millisecond or more for a save of
thousands. Lists our own code builds (a DCP bucket's tensors, a local shard's) are known to
hold only tensors, so they travel as one blob of descriptors per list.

A :class:`SourcedBatch` goes one step further for the async DCP writer, whose buckets must
hand the worker *detached* tensors (new objects, so the buckets' tensors die with the
write): it is staged as the detached tensors would be (plain tensors without grad) without
making them. Detaching is ~1 us per tensor (a new tensor through the dispatcher), and for a
staged request nothing but the bytes and the layout ever leaves the trainer, so the
detached objects would be made only to be described and dropped.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

# The exact types of the tensors staging can describe without any check beyond its layout
# (no subclass with state of its own): what a batch may hold, and what the steady-state
# walks of the DCP and local flows treat as plain tensors.
PLAIN_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})


class TensorBatch(list):
    """Tensors that staging describes in one reducer call: one pickled blob of descriptors
    per batch, not one per tensor.

    For lists our own code builds, whose elements are never the same tensor object as
    elsewhere in the request: unlike pickling them one by one, a batch does not share
    rebuilt *objects* with the rest of the request (storages are still shared: every slot
    is keyed by its storage). Unpickled, it is a plain list.
    """

    __slots__ = ()


class SourcedBatch:
    """A batch of tensors found only when staging meets it, staged as their ``detach()``.

    ``checked()`` gives the tensors to copy from, after every check its owner needs (for a
    full staging). ``quick()`` gives the same tensors found without the per-tensor checks,
    or None where it cannot: only the staging cache's optimistic pickle calls it, and that
    pickle is used only if the tensors' layouts equal those of a previous *full*
    staging of the same request. The owner guarantees that equal layouts imply the checks
    pass (e.g. a storage size check is implied by equal shapes, dtypes and storage sizes).

    Pickled by anything but staging, it is the plain list of the detached tensors.
    """

    __slots__ = ("checked", "quick")

    def __init__(
        self,
        checked: Callable[[], list[torch.Tensor]],
        quick: Callable[[], list[torch.Tensor] | None],
    ) -> None:
        self.checked = checked
        self.quick = quick

    def __reduce_ex__(self, protocol: object) -> tuple:
        return list, (list(map(torch.Tensor.detach, self.checked())),)


# A dict with fewer tensors gains less from one batch than its checks cost.
MIN_BATCHED = 8
_DICTS = (dict, OrderedDict)


class TensorDict:
    """A ``dict`` (or ``OrderedDict``, with its attributes) of distinct tensors, staged as
    one :class:`TensorBatch`; unpickled, it is the same dict again.

    For the ``torch.save`` flow, whose state is the user's: a model's ``state_dict()`` is one
    dict of hundreds to thousands of tensors, each a reducer call and a descriptor of its own
    otherwise (~0.7 us per tensor, cache-cold, on a steady save). Its tensors are rebuilt as
    the batch's objects: a tensor of the dict that the rest of the state also holds (the very
    object, not a view or a tied weight, which share storages and stay shared) is rebuilt as
    a second tensor over the same storage.
    """

    __slots__ = ("attrs", "keys", "kind", "tensors")

    def __init__(
        self, kind: type, keys: list, tensors: TensorBatch, attrs: dict | None = None
    ) -> None:
        self.kind = kind
        self.keys = keys
        self.tensors = tensors
        self.attrs = attrs

    def __reduce_ex__(self, protocol: object) -> tuple:
        return _rebuild_dict, (self.kind, self.keys, self.tensors, self.attrs)


def _rebuild_dict(kind: type, keys: list, tensors: list, attrs: dict | None) -> dict:
    rebuilt = kind(zip(keys, tensors, strict=True))
    if attrs:
        rebuilt.__dict__.update(attrs)
    return rebuilt


def _as_batch(obj: Any) -> TensorDict | None:
    """``obj`` as a :class:`TensorDict` if it is a dict of at least ``MIN_BATCHED`` distinct
    tensors (checked by C-level passes), else None."""
    if type(obj) not in _DICTS or len(obj) < MIN_BATCHED:
        return None
    values = list(obj.values())
    if not set(map(type, values)) <= PLAIN_TENSOR_TYPES or len(set(map(id, values))) != len(values):
        return None
    return TensorDict(type(obj), list(obj), TensorBatch(values), _attributes(obj))


def _attributes(obj: dict) -> dict | None:
    """An ``OrderedDict``'s own attributes (a module ``state_dict()``'s ``_metadata``)."""
    return dict(vars(obj)) if type(obj) is OrderedDict and vars(obj) else None


def batch_tensor_dicts(state: Any) -> Any:
    """``state`` with its dicts of tensors as :class:`TensorDict`: ``state`` itself, or its
    direct dict values (the ``"model"`` of ``{"model": ..., "optimizer": ..., "step": ...}``);
    nothing deeper, so the cost is a few C-level passes per candidate dict. The caller's
    objects are not changed (a new outer dict of the same type holds the replacements), and a
    dict met under two keys stays one object."""
    whole = _as_batch(state)
    if whole is not None:
        return whole
    if type(state) not in _DICTS:
        return state
    replaced: dict[int, TensorDict | None] = {}
    for value in state.values():
        if type(value) in _DICTS and id(value) not in replaced:
            replaced[id(value)] = _as_batch(value)
    if not any(replaced.values()):
        return state
    outer = type(state)(
        (key, replaced.get(id(value)) or value) if type(value) in _DICTS else (key, value)
        for key, value in state.items()
    )
    attrs = _attributes(state)
    if attrs:
        outer.__dict__.update(attrs)
    return outer


class BatchedWhenPickled:
    """``state`` staged as :func:`batch_tensor_dicts` makes it, the checks made when staging
    pickles it rather than when the save is called: with overlapped staging the pickling
    runs on the background thread, and so do the checks' passes over every tensor. Unpickled,
    it is ``state`` (the same dicts again)."""

    __slots__ = ("state",)

    def __init__(self, state: Any) -> None:
        self.state = state

    def __reduce_ex__(self, protocol: object) -> tuple:
        return _identity, (batch_tensor_dicts(self.state),)


def _identity(obj: Any) -> Any:
    return obj
