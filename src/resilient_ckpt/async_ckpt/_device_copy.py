"""The device-to-host half of a snapshot: which tensor fills each device slot, and how.

Decision: a slot holds one storage's bytes. Where one of the request's tensors *is* those
bytes in order (contiguous, at storage offset 0, covering the whole storage, no lazy
conjugate or negative bit: the common case of a parameter or an optimizer state), the copy
is that tensor itself into a view of its slot typed and shaped like it, one ``copy_`` with
nothing built per save. Any other storage (a view into a larger buffer, a transposed
tensor) is copied as its raw bytes through a ``uint8`` tensor over the storage.

The plan is a function of the tensors' layouts alone, so the staging cache keeps it with
the rest of a save's layout (:mod:`._stage_cache`), and the typed slot views are kept by the
arena they view (:meth:`._arena.Arena.kept_views`). A steady-state save of thousands of CUDA
tensors then costs what a hand-written loop of ``copy_`` calls into pinned memory costs;
built per save, the two views cost more than the copy's own launch (measured on an H100:
2000 tensors, 48 ms against the loop's 13.5 ms before this plan).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from ._arena import Arena
from ._messages import Slot

StorageKey = tuple[str, int, int]


class DeviceSlot(NamedTuple):
    """A device storage's slot (``offset``, ``nbytes``) and the request's tensor (its index,
    ``source``) read to fill it; ``whole``: that tensor is the storage's bytes in order."""

    offset: int
    nbytes: int
    source: int
    whole: bool


def is_host(storage: torch.UntypedStorage) -> bool:
    """Whether staging copies ``storage`` as host memory (memmove) rather than with ``copy_``."""
    return storage.device.type == "cpu"


class DevicePlan(NamedTuple):
    """A request's device copies: one entry per non-empty device slot, in slot order, and
    the CUDA devices they read (each synchronized before the snapshot counts as taken). Its
    identity keys the destinations an arena keeps for it."""

    slots: tuple[DeviceSlot, ...] = ()
    cuda: tuple[int, ...] = ()


NO_DEVICE = DevicePlan()


def storage_key(storage: torch.UntypedStorage) -> StorageKey:
    """How staging tells storages apart (device type, address, bytes)."""
    return (storage.device.type, storage.data_ptr(), storage.nbytes())


def _is_whole(tensor: torch.Tensor, nbytes: int) -> bool:
    return (
        tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.numel() * tensor.element_size() == nbytes
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


def plan_device_copies(
    tensors: Sequence[torch.Tensor],
    slot_of: Mapping[StorageKey, int],
    slots: Sequence[Slot],
    host: Sequence[bool],
) -> DevicePlan:
    """The plan for ``tensors``, whose storages have the slots ``slot_of`` names (``host``:
    per slot, whether it is copied as host memory instead); a tensor that is its storage's
    whole bytes is preferred over a view into it."""
    chosen: dict[int, DeviceSlot] = {}
    for index, tensor in enumerate(tensors):
        key = storage_key(tensor.untyped_storage())
        slot = slot_of.get(key) if key[2] else None
        if slot is None or host[slot]:  # empty, pickled by value (no slot), or on the host
            continue
        whole = _is_whole(tensor, key[2])
        known = chosen.get(slot)
        if known is None or (whole and not known.whole):
            chosen[slot] = DeviceSlot(slots[slot][0], key[2], index, whole)
    entries = tuple(chosen[slot] for slot in sorted(chosen))
    cuda = {tensors[e.source].get_device() for e in entries if tensors[e.source].is_cuda}
    return DevicePlan(entries, tuple(sorted(cuda)))


def _destination(arena: Arena, entry: DeviceSlot, tensor: torch.Tensor) -> torch.Tensor:
    dst = arena.view(entry.offset, entry.nbytes)
    return dst.view(tensor.dtype).view(tensor.shape) if entry.whole else dst


def device_pairs(
    plan: DevicePlan,
    arena: Arena,
    tensors: Sequence[torch.Tensor],
    *,
    keep: bool = False,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(destination, source)`` for each entry of ``plan``, into ``arena``.

    ``keep``: the plan is the staging cache's, reused save after save: the destinations are
    built once per arena and kept by it.
    """
    if not plan.slots:
        return []
    views = arena.kept_views(plan) if keep else None
    if views is None:
        views = [_destination(arena, entry, tensors[entry.source]) for entry in plan.slots]
        if keep:
            arena.keep_views(plan, views)
    pairs = []
    for entry, dst in zip(plan.slots, views, strict=True):
        src = tensors[entry.source]
        if not entry.whole:
            raw = torch.empty(0, dtype=torch.uint8, device=src.device)
            src = raw.set_(src.untyped_storage())
        pairs.append((dst, src))
    return pairs
