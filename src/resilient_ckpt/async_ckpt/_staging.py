"""Snapshotting a request's tensors into reusable shared memory.

Decision: the trainer copies every tensor reachable from a request (its ``async_fn``,
arguments, keyword arguments and ``preload_fn``, however deeply nested, inside dataclasses
and partials too) into an *arena*: one ``memfd`` shared-memory region mapped by both the
trainer and its worker. When ``schedule_async_request`` returns, the checkpoint content is
fixed; training may change its tensors at once.

How: the request is pickled once with a :class:`pickle.Pickler` whose ``dispatch_table``
maps ``torch.Tensor`` and ``Parameter`` to a reducer that replaces each strided CPU or CUDA
tensor by a small descriptor (slot, dtype, size, stride, offset). The table is looked up by
the C pickler only for objects of those types, so the cost is one Python call per tensor,
not one per pickled object (a ``persistent_id`` method is called for every object: ~75 per
DCP write item). Tensors are grouped by *storage*, so views and tied weights stay shared
exactly as ``torch.save`` would see them. The slots are laid out in the arena
(:mod:`._copy`: host storages near each other in memory keep their relative places) and
filled there (memmove on copy threads; ``copy_`` device-to-host for CUDA),
in the save call or, in overlapped mode, with the whole of :func:`stage` on a background
thread until ``wait_for_snapshot`` (:mod:`._snapshot`). In the worker, unpickling rebuilds
each descriptor as a tensor whose storage is exactly its slot (:mod:`._unstaging`).

Alternatives rejected:

* ``torch.multiprocessing`` queues move CPU tensors into shared memory *in place*
  (``share_memory_``): the trainer's own tensors would alias the checkpoint, and each save
  would make new segments.
* ``multiprocessing.shared_memory`` leaves named files in ``/dev/shm`` when a process is
  killed (see :mod:`._arena`).
* Caching the pickled request across saves: its non-tensor part changes every save (paths,
  tokens), and for a dict of tensors the pickle is already as cheap as reading each
  tensor's layout. What is expensive and stable, the DCP write items, is cached per plan
  where the plan is (:mod:`._dcp_buckets`).

Arenas are kept in a pool (:mod:`._arena`) and reused for every save whose bytes fit, so in
steady state no segment is created per save and host memory does not grow.
"""

from __future__ import annotations

import copyreg
import importlib
import io
import pickle
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .._logging import get_logger
from ..errors import CheckpointingException, InvalidRequestError
from . import _copy
from ._arena import Arena, ArenaPool
from ._batch import SourcedBatch, TensorBatch
from ._copy import (
    NO_DEVICE,
    DeviceOrder,
    DevicePlan,
    Placement,
    StorageKey,
    copy_all,
    place,
    plan_device_copies,
    start_copies,
    storage_key,
)
from ._messages import Slot, SlotTable
from ._stage_cache import StageCache
from ._unstaging import rebuild_batch, rebuild_staged

logger = get_logger(__name__)


@dataclass
class _PendingSlot:
    storage: torch.UntypedStorage
    nbytes: int
    host: bool  # copied as host memory (memmove), else with copy_ (see _copy)
    offset: int = 0


def _reduce_module(module: types.ModuleType) -> Any:
    # Modules (e.g. torch.save's pickle_module=pickle) travel by name.
    return importlib.import_module, (module.__name__,)


def _stageable(obj: torch.Tensor) -> bool:
    # A tensor with a lazy conjugate or negative bit goes by value, where torch's own
    # reducer keeps the bit (a descriptor of its bytes would lose it).
    return (
        obj.layout == torch.strided
        and obj.device.type != "meta"
        and not obj.is_quantized
        and not obj.is_conj()
        and not obj.is_neg()
    )


class _Collector:
    """Per-pickle state: the storages met so far, by identity, in order of first use.

    It also records, per reducer call, what :mod:`._stage_cache` needs to reuse this pickle's
    descriptors: the result and how many tensors the call described (one, or a
    :class:`TensorBatch`'s length), and the tensors in order (for their layouts, see
    :func:`._stage_cache.layouts`). ``reusable`` turns False when a tensor is pickled by value.
    """

    def __init__(self) -> None:
        self.slots: list[_PendingSlot] = []
        self.slot_of: dict[StorageKey, int] = {}
        self.tensors: list[torch.Tensor] = []
        self.reduced: list[Any] = []
        self.counts: list[int] = []
        self.reusable = True

    def _describe(self, obj: torch.Tensor, detached: bool = False) -> tuple:
        """The arguments of ``rebuild_staged`` for ``obj`` (for ``obj.detach()`` if
        ``detached``), its storage given a slot."""
        storage = obj.untyped_storage()
        key = storage_key(storage)
        nbytes = key[2]
        slot = self.slot_of.get(key)
        if slot is None or nbytes == 0:
            slot = len(self.slots)
            self.slots.append(_PendingSlot(storage, nbytes, _copy.is_host(storage)))
            self.slot_of[key] = slot
        return (
            slot,
            obj.dtype,
            tuple(obj.size()),
            obj.stride(),
            obj.storage_offset(),
            obj.requires_grad and not detached,
            type(obj) is torch.nn.Parameter and not detached,
        )

    def reduce_tensor(self, obj: torch.Tensor) -> Any:
        self.tensors.append(obj)
        self.counts.append(1)
        if not _stageable(obj):
            self.reusable = False
            reduced = obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        else:
            reduced = (rebuild_staged, self._describe(obj))
        self.reduced.append(reduced)
        return reduced

    def reduce_batch(self, batch: TensorBatch) -> Any:
        return self._batch(batch, detached=False)

    def reduce_sourced(self, batch: SourcedBatch) -> Any:
        return self._batch(batch.checked(), detached=True)

    def _batch(self, tensors: list[torch.Tensor], *, detached: bool) -> Any:
        if not all(isinstance(t, torch.Tensor) and _stageable(t) for t in tensors):
            # Element by element (each through the dispatch table): by value where needed.
            self.reusable = False
            if detached:
                tensors = [t.detach() if isinstance(t, torch.Tensor) else t for t in tensors]
            return list, (tuple(tensors),)
        descriptors = [self._describe(t, detached) for t in tensors]
        self.tensors.extend(tensors)
        self.counts.append(len(tensors))
        reduced = (
            rebuild_batch,
            (pickle.dumps(descriptors, protocol=pickle.HIGHEST_PROTOCOL),),
        )
        self.reduced.append(reduced)
        return reduced


def _dispatch_table(collector: Any) -> dict[type, Any]:
    """Tensors become arena descriptors; found by a type lookup inside the C pickler.

    A ``persistent_id`` method would be a Python call for *every* object pickled (about 75
    per DCP write item); the dispatch table costs one call per tensor only. Pickle memoizes
    the reduced tensor, so a tensor met twice is rebuilt once (identity preserved), and
    tensors sharing a storage share one slot (views and tied weights stay shared).
    """
    table: dict[type, Any] = dict(copyreg.dispatch_table)
    table[torch.Tensor] = collector.reduce_tensor
    table[torch.nn.Parameter] = collector.reduce_tensor
    table[TensorBatch] = collector.reduce_batch
    table[SourcedBatch] = collector.reduce_sourced
    table[types.ModuleType] = _reduce_module
    return table


@dataclass
class StagedRequest:
    """A pickled request and the arena its tensors' bytes were copied into."""

    payload: bytes
    arena: Arena | None
    slots: tuple[Slot, ...]
    nbytes: int


def dump_with(obj: Any, reducer_owner: Any) -> bytes:
    """Pickle ``obj``; tensors go through ``reducer_owner.reduce_tensor``, batches of them
    through ``reducer_owner.reduce_batch``."""
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = _dispatch_table(reducer_owner)
    pickler.dump(obj)
    return buf.getvalue()


def collect_descriptors(obj: Any, what: str) -> tuple[bytes, _Collector]:
    """Pickle ``obj`` with tensors replaced by descriptors; name ``what`` on failure."""
    collector = _Collector()
    try:
        payload = dump_with(obj, collector)
    except CheckpointingException:
        raise  # ours (e.g. a write item resolved late to a non-tensor) say what happened
    except Exception as exc:
        raise InvalidRequestError(
            f"{what} cannot be sent to the background worker: {type(exc).__name__}: {exc}. "
            "Use module-level functions (not lambdas or local functions) and picklable "
            "arguments, or functools.partial of them."
        ) from exc
    return payload, collector


def _layout(slots: list[_PendingSlot]) -> tuple[Placement, tuple[Slot, ...]]:
    """Place ``slots`` in an arena (see :mod:`._copy`), setting each one's offset;
    the placement and the slots' table for the worker."""
    placement = place([(p.storage.data_ptr() if p.host else None, p.nbytes) for p in slots])
    for slot, offset in zip(slots, placement.offsets, strict=True):
        slot.offset = offset
    return placement, SlotTable(zip(placement.offsets, (p.nbytes for p in slots), strict=True))


def copy_into(
    arena: Arena,
    placement: Placement,
    device: DevicePlan,
    tensors: list[torch.Tensor],
    *,
    threads: int = 1,
    order: DeviceOrder | None = None,
) -> None:
    """Copy each pending storage into its arena slot (the only trainer-side data copy).

    Host storages are copied by :func:`._copy.copy_all` as the placement's runs (memmove,
    ``threads`` threads); device storages with ``copy_`` as ``device`` plans, after
    ``order`` where given (see :mod:`._copy`).
    """
    base = arena.address
    host = [(base + dst, src, n) for dst, src, n in placement.runs]
    device_wait = start_copies(device, arena, tensors, order=order)  # run while host copies
    copy_all(host, threads=threads, device_wait=device_wait)


def stage(
    obj: Any,
    pool: ArenaPool,
    wait_for_release: Callable[[], bool],
    what: str = "the async request",
    *,
    threads: int = 1,
    cache: StageCache | None = None,
    order: DeviceOrder | None = None,
) -> StagedRequest:
    """Pickle ``obj`` and copy its tensors into an arena from ``pool``.

    ``order``: the save call's place in the CUDA streams, when this runs on the staging
    thread (overlapped staging, see :class:`._copy.DeviceOrder`).
    With ``cache``, a request laid out like the previous one reuses its descriptors and copy
    plan (:mod:`._stage_cache`); otherwise it is staged fully and the cache rebuilt.
    """
    if cache is not None:
        guessed = cache.try_pickle(obj, dump_with, threads)
        if guessed is not None:
            payload, tensors = guessed
            if not cache.slots:
                return StagedRequest(payload, None, (), 0)
            arena = cache.copy(pool, wait_for_release, tensors, order=order)
            return StagedRequest(payload, arena, cache.slots, cache.total)
    payload, collector = collect_descriptors(obj, what)
    placement, slots = _layout(collector.slots)
    total = placement.total
    device = _device_plan(collector, slots)
    if cache is not None:
        _remember(cache, collector, slots, placement, device, threads)
    if not slots:
        return StagedRequest(payload, None, (), 0)
    if cache is not None and cache.planned_for(slots):
        # Copy with the plan just cached, not a second coalesce/split.
        arena = cache.copy(pool, wait_for_release, collector.tensors, order=order)
    else:
        arena = pool.acquire(total, wait_for_release)
        try:
            copy_into(arena, placement, device, collector.tensors, threads=threads, order=order)
        except BaseException:
            pool.release(arena.arena_id)
            raise
    return StagedRequest(payload, arena, slots, total)


def _device_plan(collector: _Collector, slots: tuple[Slot, ...]) -> DevicePlan:
    host = [s.host for s in collector.slots]
    if all(host):
        return NO_DEVICE
    return plan_device_copies(collector.tensors, collector.slot_of, slots, host)


def _remember(
    cache: StageCache,
    collector: _Collector,
    slots: tuple[Slot, ...],
    placement: Placement,
    device: DevicePlan,
    threads: int,
    *,
    counted: bool = True,
) -> None:
    cache.remember(
        collector.tensors,
        collector.reduced,
        collector.counts,
        collector.reusable,
        slots,
        list(placement.runs),
        device,
        placement.total,
        threads,
        counted=counted,
    )


def prime(
    obj: Any, cache: StageCache, threads: int, what: str = "the warm-up state"
) -> tuple[int, list[torch.Tensor]]:
    """Fill ``cache`` as a full staging of ``obj`` would, copying nothing; the arena bytes
    ``obj`` needs and its tensors in the cache's order (for :meth:`StageCache.prepare`).

    A later request that meets the same tensors, laid out alike and in the same order (e.g.
    the warm-up state inside the request that saves it), is then staged by the fast path
    from its first save on. Any other request simply misses (see :mod:`._stage_cache`).
    """
    _, collector = collect_descriptors(obj, what)
    placement, slots = _layout(collector.slots)
    device = _device_plan(collector, slots)
    _remember(cache, collector, slots, placement, device, threads, counted=False)
    return placement.total, collector.tensors
