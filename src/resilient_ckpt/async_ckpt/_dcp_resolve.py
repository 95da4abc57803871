"""Resolving a save plan's tensor items to the tensors the async DCP writer snapshots.

Decision: the writer must own what it writes: read as a list, every item resolves to a
*new* tensor object (a detached view of the state's memory), so the buckets' tensors die
with the write (NVRx's "writer hands its payload over" tests hold weak references to them),
and a CPU view into a larger storage is cloned (else staging would copy the whole base
storage, and torch's writer would clone it anyway). Staging needs no new objects: it reads
the *sources* (the state's own tensors, or those clones) and describes them as detached
(see ``SourcedBatch``); detaching 2000 tensors would cost ~2 ms a save.

For a :class:`DefaultSavePlanner` an item is a lookup in the planner's flat state (its
generic ``resolve_data`` builds index objects per item; DTensors' ``to_local`` goes through
autograd). When every item of a file is a plain tensor, or every one a Shard/Replicate
DTensor over one, the lookups and checks are C-level ``map`` passes over all items
(:func:`_uniform_tensors`, :func:`_plain_cpu`); any other mix is resolved item by item.
"""

from __future__ import annotations

import itertools
import operator
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner

from .._torch_compat import DTensor, Replicate, Shard
from ..errors import ConfigurationError
from ._staging import PLAIN_TENSOR_TYPES

if TYPE_CHECKING:
    from ._dcp_buckets import ItemsBlob

_DTENSOR_ONLY = frozenset({DTensor})
_NOT_PARTIAL = frozenset({Shard, Replicate})
_LOCAL_TENSOR = operator.attrgetter("_local_tensor")
_PLACEMENTS = operator.attrgetter("_spec.placements")
_IS_CPU = operator.attrgetter("is_cpu")
_NBYTES = operator.attrgetter("nbytes")


def snapshot_source(tensor: Any, fqn: str) -> torch.Tensor:
    """What a snapshot of ``tensor`` copies from: ``tensor`` itself, or a clone of a CPU
    view whose storage is larger than its bytes (see the module docstring)."""
    if not isinstance(tensor, torch.Tensor):
        raise ConfigurationError(
            f"the planner resolved tensor item {fqn!r} to a {type(tensor).__name__}"
        )
    if tensor.device.type == "cpu":
        if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
            return tensor.detach().clone()
    return tensor


def direct_lookup(planner: SavePlanner) -> dict[str, Any] | None:
    """The planner's flat state when resolving a tensor item is a plain lookup in it."""
    cls = type(planner)
    if not isinstance(planner, DefaultSavePlanner) or any(
        getattr(cls, name) is not getattr(DefaultSavePlanner, name)
        for name in ("resolve_data", "lookup_object", "transform_object")
    ):
        return None
    state = getattr(planner, "state_dict", None)
    return state if isinstance(state, dict) else None


def resolve_blob(blob: ItemsBlob, planner: SavePlanner, flat: dict[str, Any] | None) -> list:
    """A new detached tensor per item of ``blob`` (its snapshot view, see the module
    docstring)."""
    return list(map(torch.Tensor.detach, resolve_sources(blob, planner, flat)))


def resolve_sources(blob: ItemsBlob, planner: SavePlanner, flat: dict[str, Any] | None) -> list:
    """``snapshot_source`` of each of ``blob``'s items as ``planner`` resolves it; ``flat``
    (from :func:`direct_lookup`) lets plain tensors and non-partial DTensors be looked up
    directly."""
    if flat is None:
        return [snapshot_source(planner.resolve_data(i), i.index.fqn) for i in blob.items]
    tensors = _uniform_tensors(blob, flat)
    if tensors is not None and _plain_cpu(tensors):
        return list(tensors)
    out: list[torch.Tensor] = []
    for item, fqn in zip(blob.items, blob.fqns, strict=True):
        obj: Any = flat.get(fqn)
        kind = type(obj)
        tensor: Any = None
        if kind in PLAIN_TENSOR_TYPES:
            tensor = obj
        elif kind is DTensor and type(local := obj._local_tensor) is torch.Tensor:
            if not any(p.is_partial() for p in obj._spec.placements):
                tensor = local
        out.append(snapshot_source(planner.resolve_data(item) if tensor is None else tensor, fqn))
    return out


def quick_sources(blob: ItemsBlob, flat: dict[str, Any]) -> list | None:
    """:func:`resolve_sources` without the per-tensor checks, for the staging cache's
    optimistic pickle (see ``SourcedBatch``): None unless every item is looked up directly
    by the C-level passes.

    Unchecked here, implied by layouts equal to a full staging's: every tensor is on
    the CPU (the layout holds the device) and none is a view into a larger storage (equal
    shapes, dtypes and storage sizes to tensors that were not; a cloned view's key holds
    the clone's storage, never equal to the view's).
    """
    tensors = _uniform_tensors(blob, flat)
    return None if tensors is None else list(tensors)


def _uniform_tensors(blob: ItemsBlob, flat: dict[str, Any]) -> tuple | None:
    """The items' tensors by C-level passes over all items at once, when every item is a
    plain tensor or every item a non-partial DTensor over a plain tensor; None otherwise
    (the loop of :func:`resolve_sources` decides per item)."""
    try:
        objs = blob.lookup(flat)
    except KeyError:
        return None
    kinds = set(map(type, objs))
    if kinds <= PLAIN_TENSOR_TYPES:
        return objs
    if kinds != _DTENSOR_ONLY:
        return None
    placement_kinds = set(map(type, itertools.chain.from_iterable(map(_PLACEMENTS, objs))))
    if not placement_kinds <= _NOT_PARTIAL:
        return None
    tensors = tuple(map(_LOCAL_TENSOR, objs))
    if set(map(type, tensors)) - {torch.Tensor}:
        return None
    return tensors


def _plain_cpu(tensors: tuple) -> bool:
    """Every tensor on the CPU, none a view into a larger storage."""
    if not all(map(_IS_CPU, tensors)):
        return False
    storage_bytes = map(torch.UntypedStorage.nbytes, map(torch.Tensor.untyped_storage, tensors))
    return not any(map(operator.ne, storage_bytes, map(_NBYTES, tensors)))
