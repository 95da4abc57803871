"""Staging: a request's tensors snapshotted into reusable shared memory, and back out.

Decision: the trainer copies every tensor reachable from a request (its ``async_fn``,
arguments, keyword arguments and ``preload_fn``, however deeply nested, inside dataclasses
and partials too) into an *arena*: one ``memfd`` shared-memory region mapped by both the
trainer and its worker (:mod:`._arena`). When ``schedule_async_request`` returns, the
checkpoint content is fixed; training may change its tensors at once. Arenas are kept in a
pool and reused for every save whose bytes fit, so in steady state no segment is created per
save and host memory does not grow.

Trainer side: the request is pickled once with a :class:`pickle.Pickler` whose
``dispatch_table`` maps ``torch.Tensor`` and ``Parameter`` to a reducer that replaces each
strided CPU or CUDA tensor by a small descriptor (slot, dtype, size, stride, offset). The
table is looked up by the C pickler only for objects of those types, so the cost is one
Python call per tensor, not one per pickled object (a ``persistent_id`` method is called for
every object, dozens per DCP write item). Tensors are grouped by *storage*, so views and tied
weights stay shared exactly as ``torch.save`` would see them. The slots are laid out in the
arena and filled by :mod:`._copy` (memmove on copy threads; ``copy_`` device-to-host for
CUDA). A request laid out like the previous one reuses its descriptors and copy plan
(:mod:`._stage_cache`).

Batches: a reducer call and a descriptor pickled per tensor add up for a save of thousands.
Lists our own code builds (a DCP bucket's tensors, a local shard's) are known to hold only
tensors, so they travel as one blob of descriptors per list (:class:`TensorBatch`). A
:class:`SourcedBatch` (the async DCP writer's bucket, whose tensors the worker must get
*detached*) is staged as the detached tensors would be, without making them: nothing but the
bytes and the layout ever leaves the trainer. A ``torch.save`` state's dicts of tensors are
batched too (:class:`TensorDict`), except where a batch would not rebuild the objects
``torch.save`` would see.

Worker side (:func:`unstage`): unpickling rebuilds each descriptor as a tensor whose storage is
exactly its slot of the arena, one storage per slot. A function or class of the trainer's
``__main__`` is found through :class:`._worker.MainAwareUnpickler`, which imports that module
only then.

Overlapped staging (``schedule_async_request(..., overlap_staging=True)``): the call returns
at once and the whole of :func:`stage` (pickling, the staging cache's check, the arena, the
copy) runs on one background thread until ``wait_for_snapshot`` (:class:`PendingSnapshot`):
the per-tensor Python work of a request of thousands of tensors is off the trainer's path as
well as the copy. The request's objects (its containers and values, not only its tensors)
must stay unchanged until the wait, and a request that cannot be pickled is reported by the
wait instead of the call. CUDA tensors are copied on side streams ordered after the call
(:class:`._copy.DeviceOrder`). Only the trainer's thread reads the worker's results, so a
background staging must never wait for an arena: the caller makes sure one is free (or may
be created) before starting it.

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
* Issuing the device copies in the save call of an overlapped staging: the call would then
  cost more than a plain copy loop into pinned memory.

**Deferred arguments** (deferred planning). Decision: with a save's structure unchanged
since the last one, what its call decides is almost always "the cached plan still holds": a
walk over the state (cache-cold after a training step) and an all-gather of a few integers
(a round trip on a loaded node). With ``defer_planning=True`` (opt-in, every rank alike)
that decision, and the payload it leads to, move out of the call into the staging of the
request: in overlapped staging (``schedule_async_request(..., overlap_staging=True)``) that
is the background staging thread, so the save call returns after building a few objects. Two
flows offer it:

* async DCP, ``save_state_dict_async_plan(..., enable_cache=True, defer_planning=True)``:
  from the second save on, the steady-state check and, if any rank's structure changed, a
  full re-plan. The call returns the coordinator's global metadata as a placeholder that
  the planning fills in place; finalize, after the snapshot was waited for, reads the real
  one. The writer's payload (``args[1]``) is the :class:`DeferredList` of write buckets.
* local checkpoints, ``LocalCheckpointManager(..., defer_planning=True)``: an async save
  without a replication strategy checks the iteration and lays the shard out (cached) at
  staging, agreed across ranks there; the request's sources are the deferred list.

Nothing is assumed: the staging runs the very same planning as the call would, only later
and on another thread. Its collectives therefore run on the library's *background* gloo
group (:func:`resilient_ckpt._dist.background_group`), never on a group the trainer's
thread uses, so they cannot interleave with the trainer's own collectives; and it always
runs on the one staging thread of the process (:func:`in_staging_order`), so
the deferred saves of every queue plan in the order they were staged, on every rank.

What the caller gives up: errors of planning (a state dict that cannot be saved, an
iteration that is not newer, a directory that cannot be set up) are raised where the
request is staged, by ``schedule_async_request`` or, overlapped, by ``wait_for_snapshot``,
on every rank alike; and the state's structure (its containers and keys, not only its
tensors) must stay as it was until then, as overlapped staging already requires of the
values.

The persistent queue completes a request's deferred positional arguments before pickling
it (:func:`resolve_deferred`); a ``preload_fn`` that receives one completes it itself (the
fork queue and ``execute_sync`` run it in the trainer); pickled incomplete, it refuses.
"""

from __future__ import annotations

import copyreg
import importlib
import io
import pickle
import threading
import time
import types
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from .._logging import get_logger
from .._torch_compat import pending_sparse_tensors, validate_loaded_sparse_tensors
from ..errors import (
    CheckpointingException,
    CheckpointTimeoutError,
    InvalidRequestError,
    StagingError,
)
from . import _copy
from ._arena import Arena, ArenaPool
from ._copy import (
    NO_DEVICE,
    DeviceOrder,
    DevicePlan,
    Placement,
    StorageKey,
    ThreadPool,
    copy_all,
    place,
    plan_device_copies,
    start_copies,
    storage_key,
)
from ._structure import PLAIN_TENSOR_TYPES, StageCache
from ._worker import MainAwareUnpickler, Slot, SlotTable

logger = get_logger(__name__)


# -- batches: many tensors described in one reducer call --------------------------------------


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
    otherwise. Its tensors are rebuilt as the batch's objects, so a tensor object of the
    dict that the rest of the state also holds (the very object; views and tied weights only
    share storages, which stay shared by slot) would be rebuilt as a second object, and the
    worker's ``torch.save`` would write another archive than the trainer's. Staging therefore
    knows the ids of every batched tensor (:func:`batch_tensor_dicts`): two batched dicts
    that share one are not batched at all, and a tensor staged on its own whose id is among
    them (one set lookup per tensor) stages the state again without batches
    (:class:`MetTwice`). Such a state costs a second pickle; the common one, a state whose
    dicts of tensors hold their own tensors, costs one set lookup per other tensor.
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


def _as_batch(obj: Any) -> tuple[TensorDict, set[int]] | None:
    """``obj`` as a :class:`TensorDict` and its tensors' ids, if it is a dict of at least
    ``MIN_BATCHED`` distinct tensors (checked by C-level passes), else None."""
    if type(obj) not in _DICTS or len(obj) < MIN_BATCHED:
        return None
    values = list(obj.values())
    ids = set(map(id, values))
    if not set(map(type, values)) <= PLAIN_TENSOR_TYPES or len(ids) != len(values):
        return None
    return TensorDict(type(obj), list(obj), TensorBatch(values), _attributes(obj)), ids


def _attributes(obj: dict) -> dict | None:
    """An ``OrderedDict``'s own attributes (a module ``state_dict()``'s ``_metadata``)."""
    return dict(vars(obj)) if type(obj) is OrderedDict and vars(obj) else None


def batch_tensor_dicts(state: Any) -> tuple[Any, set[int]]:
    """``state`` with its dicts of tensors as :class:`TensorDict`, and the ids of the tensors
    batched: ``state`` itself, or its direct dict values (the ``"model"`` of
    ``{"model": ..., "optimizer": ..., "step": ...}``); nothing deeper, so the cost is a few
    C-level passes per candidate dict. The caller's objects are not changed (a new outer dict
    of the same type holds the replacements), and a dict met under two keys stays one object.
    Two dicts that share a tensor object cannot both be batches: then none is."""
    whole = _as_batch(state)
    if whole is not None:
        return whole
    if type(state) not in _DICTS:
        return state, set()
    replaced: dict[int, TensorDict | None] = {}
    batched: set[int] = set()
    held = 0
    for value in state.values():
        if type(value) in _DICTS and id(value) not in replaced:
            found = _as_batch(value)
            replaced[id(value)] = found[0] if found else None
            if found is not None:
                batched |= found[1]
                held += len(found[1])
    if not batched or len(batched) != held:
        return state, set()
    outer = type(state)(
        (key, replaced.get(id(value)) or value) if type(value) in _DICTS else (key, value)
        for key, value in state.items()
    )
    attrs = _attributes(state)
    if attrs:
        outer.__dict__.update(attrs)
    return outer, batched


class MetTwice(Exception):
    """A batched tensor was met outside its batch: the request must be staged again with
    its state unbatched (see :class:`TensorDict`)."""


class BatchedWhenPickled:
    """``state`` staged as :func:`batch_tensor_dicts` makes it, the checks made when staging
    pickles it rather than when the save is called: with overlapped staging the pickling
    runs on the background thread, and so do the checks' passes over every tensor. Unpickled,
    it is ``state`` (the same dicts again). Pickled by anything but staging, it is ``state``
    as it is."""

    __slots__ = ("state",)

    def __init__(self, state: Any) -> None:
        self.state = state

    def reduce(self, batched: set[int] | None) -> tuple:
        """The reduction staging pickles: with ``batched``, the state with its dicts of
        tensors batched, their tensors' ids added to ``batched`` (for the reducer of single
        tensors to check, see :class:`TensorDict`); with None, the state as it is."""
        if batched is None:
            return _identity, (self.state,)
        state, ids = batch_tensor_dicts(self.state)
        batched |= ids
        return _identity, (state,)

    def __reduce_ex__(self, protocol: object) -> tuple:
        return self.reduce(None)


def _identity(obj: Any) -> Any:
    return obj


# -- trainer side: pickling a request into descriptors, copying its storages ----------------


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

    ``batch_dicts``: whether a :class:`BatchedWhenPickled` state is staged with its dicts
    batched; ``batched`` holds the ids of the tensors so batched (see :class:`TensorDict`).
    """

    def __init__(self, *, batch_dicts: bool = True) -> None:
        self.batch_dicts = batch_dicts
        self.batched: set[int] = set()
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

    def reduce_state(self, state: BatchedWhenPickled) -> tuple:
        return state.reduce(self.batched if self.batch_dicts else None)

    def reduce_tensor(self, obj: torch.Tensor) -> Any:
        if id(obj) in self.batched:
            raise MetTwice
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
            # Pickled one by one, its tensors are memoized, so met again they stay one object.
            self.reusable = False
            self.batched.difference_update(map(id, tensors))
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
    table[BatchedWhenPickled] = collector.reduce_state
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
    """Pickle ``obj`` with tensors replaced by descriptors; name ``what`` on failure. A
    batched tensor met twice (:class:`MetTwice`) has it pickled again without batches."""
    collector = _Collector()
    try:
        try:
            payload = dump_with(obj, collector)
        except MetTwice:
            collector = _Collector(batch_dicts=False)
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
        collector.batch_dicts,
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


# -- worker side: a staged request unpickled over its arena -----------------------------------


class _UnstageContext(threading.local):
    arena: Arena | None = None
    slots: tuple[Slot, ...] = ()
    storages: dict[int, torch.UntypedStorage] | None = None


_unstaging = _UnstageContext()


def rebuild_staged(
    slot: int,
    dtype: torch.dtype,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    offset: int,
    requires_grad: bool,
    is_param: bool,
) -> torch.Tensor:
    """Worker side: a tensor whose storage is its slot of the arena being unstaged."""
    storages = _unstaging.storages
    if storages is None:
        raise StagingError("a staged tensor was unpickled outside of unstage()")
    storage = storages.get(slot)
    if storage is None:
        arena = _unstaging.arena
        if arena is None:
            raise StagingError("request references staged tensors but no arena")
        offset_in_arena, nbytes = _unstaging.slots[slot]
        storage = arena.view(offset_in_arena, nbytes).untyped_storage()
        storages[slot] = storage
    tensor = torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)
    if is_param:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor


def rebuild_batch(descriptors: bytes) -> list[torch.Tensor]:
    """Worker side: a :class:`TensorBatch`'s tensors, each over its slot."""
    return [rebuild_staged(*args) for args in pickle.loads(descriptors)]


def unstage(payload: bytes, arena: Arena | None, slots: tuple[Slot, ...]) -> Any:
    """Worker side: unpickle a staged request; its tensors view ``arena``."""
    _unstaging.arena, _unstaging.slots, _unstaging.storages = arena, slots, {}
    try:
        # Finds the trainer's __main__ names, importing that module only if asked to.
        obj = MainAwareUnpickler(io.BytesIO(payload)).load()
    except BaseException:
        pending_sparse_tensors().clear()
        raise
    finally:
        _unstaging.arena, _unstaging.slots, _unstaging.storages = None, (), None
    # What torch.load does after unpickling: torch's sparse-tensor rebuild puts every sparse
    # tensor on a process-wide list to validate once its storages are loaded. Not emptied
    # here, the list would keep them (and the arena memory they view) alive until some later
    # torch.load in this process validates them, by then over reused memory (torch 2.5 then
    # fails that unrelated load: "size is inconsistent with indices").
    validate_loaded_sparse_tensors()
    return obj


# -- overlapped staging: the snapshot on a background thread ----------------------------------

_STAGER_PREFIX = "resilient_ckpt-stage"
_STAGER = ThreadPool(_STAGER_PREFIX)

T = TypeVar("T")


def in_staging_order(fn: Callable[[], T]) -> T:
    """``fn()`` on the staging thread, after every background staging submitted before it.

    The planning of deferred saves (see :mod:`._staging`) runs collectives on a group of
    its own; running it here keeps those collectives in the order the saves were staged in,
    the same on every rank, even when one queue's overlapped staging is still running while
    another queue (or the fork queue's ``preload_fn``) plans a save in the trainer's thread.
    """
    if threading.current_thread().name.startswith(_STAGER_PREFIX):
        return fn()
    return _STAGER.get(1).submit(fn).result()


def _timed(stage: Callable[[], StagedRequest]) -> tuple[StagedRequest, float]:
    started = time.perf_counter()
    staged = stage()
    return staged, time.perf_counter() - started


class PendingSnapshot:
    """One overlapped snapshot: its staging, running on the staging thread."""

    def __init__(self, call_idx: int, stage: Callable[[], StagedRequest]) -> None:
        self.call_idx = call_idx
        self._future: Future[tuple[StagedRequest, float]] | None = _STAGER.get(1).submit(
            _timed, stage
        )

    def wait(self, timeout: float) -> tuple[StagedRequest, float]:
        """The complete staged request and the staging's seconds. Raises what the staging
        raised; on a deadline, the staging still running releases its arena through
        ``release`` given to :meth:`abandon`."""
        if self._future is None:
            raise StagingError(f"snapshot of async request {self.call_idx} was already abandoned")
        try:
            staged, staging_s = self._future.result(timeout)
        except TimeoutError as exc:
            raise CheckpointTimeoutError(
                f"the snapshot of async request {self.call_idx} was not staged within "
                f"{timeout:.0f}s"
            ) from exc
        self._future = None
        return staged, staging_s

    def abandon(self, release: Callable[[int], None], timeout: float | None = None) -> None:
        """Give up this snapshot: its arena goes back to the pool once nothing writes it.

        ``timeout``: how long to wait for the staging here (None: do not wait; a staging
        still running then releases its arena when it ends).
        """
        future, self._future = self._future, None
        if future is None:
            return
        future.add_done_callback(lambda f: self._release_result(f, release))
        if timeout is not None:
            try:
                future.result(timeout)
            except BaseException as exc:  # reported by whoever waited, or lost with it
                logger.debug("abandoned staging of request %d: %r", self.call_idx, exc)

    @staticmethod
    def _release_result(future: Future[Any], release: Callable[[int], None]) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        staged, _ = future.result()
        if staged.arena is not None:
            release(staged.arena.arena_id)


class DeferredArgument:
    """An argument of an ``AsyncRequest`` completed where the request is staged (in
    overlapped staging, on the staging thread): :meth:`resolve` completes it in place, once;
    later calls return it as it is."""

    def resolve(self) -> Any:
        raise NotImplementedError


def resolve_deferred(args: tuple | list) -> None:
    """Complete the request's deferred positional arguments, before it is pickled."""
    for arg in args:
        if isinstance(arg, DeferredArgument):
            arg.resolve()


class DeferredList(list, DeferredArgument):
    """A list that stays empty until :meth:`resolve` plans the save that fills it.

    ``complete`` plans the save and fills this list (through :meth:`fill`). It runs once:
    a failure is kept and raised again by every later call, since running the planning's
    collectives again on one rank alone would leave it waiting for the others.
    """

    def __init__(self, complete: Callable[[], None], what: str) -> None:
        super().__init__()
        self._complete: Callable[[], None] | None = complete
        self._what = what
        self._filled = False
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def fill(self, items: list) -> None:
        """The planned contents (called while :meth:`resolve` runs)."""
        self[:] = items
        self._filled = True

    def resolve(self) -> DeferredList:
        if self._filled:
            return self
        return in_staging_order(self._resolve_here)

    def _resolve_here(self) -> DeferredList:
        with self._lock:
            if self._error is not None:
                raise InvalidRequestError(
                    f"the deferred planning of {self._what} failed before: {self._error}"
                ) from self._error
            complete, self._complete = self._complete, None
            if complete is not None:
                try:
                    complete()
                except BaseException as exc:
                    self._error = exc
                    raise
                if not self._filled:
                    self._error = InvalidRequestError(f"the planning of {self._what} gave nothing")
                    raise self._error
        return self

    @property
    def resolved(self) -> bool:
        return self._filled

    def __reduce_ex__(self, protocol: Any) -> Any:
        if not self._filled:
            raise InvalidRequestError(
                f"{self._what} was made with defer_planning=True and is not planned yet: "
                "schedule its request on an AsyncCallsQueue (its staging plans it) or call "
                "the request's preload_fn first"
            )
        return list, (list(self),)


def resolved(value: Any) -> Any:
    """``value``, completed first if it is a deferred argument (for ``preload_fn``s)."""
    if isinstance(value, DeferredArgument):
        value.resolve()
    return value
