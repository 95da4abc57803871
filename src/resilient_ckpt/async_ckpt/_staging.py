"""Staging: a request's tensors snapshotted into reusable shared memory, and back out.

Decision: the trainer copies every tensor reachable from a request (``async_fn``, arguments,
``preload_fn``, however deeply nested) into an *arena*, one ``memfd`` region mapped by trainer
and worker (:mod:`._arena`). When ``schedule_async_request`` returns the checkpoint content is
fixed and training may change its tensors. Arenas are pooled and reused for every save whose
bytes fit, so in steady state no segment is created per save and host memory does not grow.

Trainer side: each tensor becomes a descriptor (slot, dtype, size, stride, offset). Slots are
keyed by *storage*, so views and tied weights stay shared exactly as ``torch.save`` would see
them. :mod:`._copy` fills the slots; :mod:`._structure` lets a save laid out like the
previous one reuse its descriptors and copy plan. Worker side, :func:`unstage` rebuilds each
descriptor as a tensor over its slot.

* **Explicit sources.** A request argument that is a :class:`StagingSource` (the async DCP
  writer's payload) is not pickled: it hands staging a :class:`StagingPart`, a skeleton (a
  rebuild call and its arguments) and a flat list of tensors, described in one blob; the
  request names it by index (``persistent_id``, set only for such requests, whose other
  objects are few). The payload is two pickles in one stream, the parts (descriptors and
  rebuild calls), then the request, so the worker rebuilds each part before the request
  that names it. The part's key tells a steady save from another one.
* **Anything else** is pickled with a ``dispatch_table`` that reduces each strided CPU or
  CUDA tensor to its descriptor. The C pickler consults the table only for tensor types, so
  the cost is one Python call per tensor; a ``persistent_id`` method would be called for
  every object pickled. Lists of tensors our own code builds, and a ``torch.save`` state's
  dicts of tensors, travel as one blob of descriptors (:class:`TensorBatch`,
  :class:`TensorDict`).

Overlapped staging (``overlap_staging=True``): all of :func:`stage` runs on one background
thread until ``wait_for_snapshot`` (:class:`PendingSnapshot`). The request's objects, not
only its tensors, must stay unchanged until the wait, which also raises pickling errors. CUDA
copies are ordered after the call (:class:`._copy.DeviceOrder`). Only the trainer's thread
reads worker results, so a background staging must never wait for an arena: the caller
ensures one is free first.

Rejected: ``torch.multiprocessing`` queues ``share_memory_`` CPU tensors *in place*, so the
trainer's tensors would alias the checkpoint and each save would make segments;
``multiprocessing.shared_memory`` leaves files in ``/dev/shm`` when killed; caching the
pickled request fails because its non-tensor part (paths, tokens) changes every save (the
stable, expensive part, DCP write items, is cached per plan in :mod:`._dcp_buckets`).

**Deferred planning** (``defer_planning=True``; the user's contract is in
:func:`.state_dict_saver.save_state_dict_async_plan` and ``LocalCheckpointManager``): the
request's ``preload_fn`` is a :class:`PlanStep`, the save's planning, which the persistent
queue runs first; what it stages is the planned request (the write's items in
``async_fn_args[1]``, their preload as ``preload_fn``). It is the very same
planning, later: its collectives use the library's *background* gloo group
(:func:`resilient_ckpt._dist.background_group`), so they never interleave with the trainer
thread's, and it always runs on the one staging thread (:func:`in_staging_order`), so every
rank plans deferred saves in the same order.
"""

from __future__ import annotations

import copyreg
import functools
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
from ._main_module import MainAwareUnpickler
from ._protocol import Slot, SlotTable
from ._structure import PLAIN_TENSOR_TYPES, StageCache

logger = get_logger(__name__)


# -- batches: many tensors described in one reducer call --------------------------------------


class TensorBatch(list):
    """Tensors staged in one reducer call, as one pickled blob of descriptors.

    Only for lists our own code builds: a batch shares storages (slots) with the rest of the
    request but not rebuilt tensor *objects*. Unpickled, it is a plain list.
    """

    __slots__ = ()


# A dict with fewer tensors gains less from one batch than its checks cost.
MIN_BATCHED = 8
_DICTS = (dict, OrderedDict)


class TensorDict:
    """A ``dict`` or ``OrderedDict`` (with its attributes) of distinct tensors, staged as one
    :class:`TensorBatch`; unpickled, the same dict again.

    For the ``torch.save`` flow. Its tensors are rebuilt as the batch's objects, so a tensor
    *object* also held elsewhere in the state would become two objects and the worker's
    ``torch.save`` would write a different archive. Hence :func:`batch_tensor_dicts` does not
    batch dicts that share a tensor, and a tensor met outside its batch restarts the staging
    unbatched (:class:`MetTwice`).
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
    ``MIN_BATCHED`` distinct tensors, else None.
    """
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
    """``state`` with its dicts of tensors as :class:`TensorDict`, and the batched tensors' ids.

    Looks at ``state`` and its direct dict values only. The caller's objects are not changed,
    and two dicts that share a tensor object are not batched.
    """
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
    """A batched tensor was met outside its batch: stage again unbatched."""


class BatchedWhenPickled:
    """``state`` batched by :func:`batch_tensor_dicts` when staging pickles it, not when the save is
    called, so with overlapped staging those passes run on the background thread. Pickled by
    anything but staging, it is ``state`` as it is.
    """

    __slots__ = ("state",)

    def __init__(self, state: Any) -> None:
        self.state = state

    def reduce(self, batched: set[int] | None) -> tuple:
        """The reduction: with ``batched``, the state with its dicts batched and their tensors' ids
        added to ``batched``; with None, the state as it is.
        """
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
    """Per-pickle state: the storages met so far, by identity, in order of first use, and what
    :mod:`._structure` needs to reuse the descriptors (each reducer call's result and tensor
    count, the tensors in order). ``reusable`` turns False when a tensor is pickled by value.
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
        """``rebuild_staged``'s arguments for ``obj`` (or its ``detach()``)."""
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
    """The pickler's reducers: tensors and batches become arena descriptors. Pickle memoizes each
    reduced tensor, so a tensor met twice is rebuilt once.
    """
    table: dict[type, Any] = dict(copyreg.dispatch_table)
    table[torch.Tensor] = collector.reduce_tensor
    table[torch.nn.Parameter] = collector.reduce_tensor
    table[TensorBatch] = collector.reduce_batch
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


def dump_with(
    obj: Any,
    reducer_owner: Any,
    header: tuple | None = None,
    explicit: dict[int, int] | None = None,
) -> bytes:
    """Pickle ``header`` (the explicit sources' descriptors and rebuild calls, see
    :func:`stage`), then ``obj``, with ``reducer_owner``'s reducers for tensors and batches;
    an object whose id is in ``explicit`` is pickled as that source's index."""
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = _dispatch_table(reducer_owner)
    pickler.dump(header)
    if explicit:
        pickler.persistent_id = lambda o: explicit.get(id(o))  # type: ignore[method-assign]
    pickler.dump(obj)
    return buf.getvalue()


def collect_descriptors(
    obj: Any,
    what: str,
    header: tuple | None = None,
    explicit: dict[int, int] | None = None,
    collector: _Collector | None = None,
) -> tuple[bytes, _Collector]:
    """Pickle ``obj`` with tensors as descriptors (see :func:`dump_with`), naming ``what`` on
    failure; on :class:`MetTwice` it is pickled again unbatched.
    """
    if collector is None:
        collector = _Collector()
    fresh = (len(collector.slots), len(collector.tensors), dict(collector.slot_of))
    try:
        try:
            payload = dump_with(obj, collector, header, explicit)
        except MetTwice:
            retry = _Collector(batch_dicts=False)
            retry.slots, retry.tensors = collector.slots[: fresh[0]], collector.tensors[: fresh[1]]
            retry.slot_of = fresh[2]
            collector = retry
            payload = dump_with(obj, collector, header, explicit)
    except CheckpointingException:
        raise  # ours (e.g. a write item resolved late to a non-tensor) say what happened
    except Exception as exc:
        raise InvalidRequestError(
            f"{what} cannot be sent to the background worker: {type(exc).__name__}: {exc}. "
            "Use module-level functions (not lambdas or local functions) and picklable "
            "arguments, or functools.partial of them."
        ) from exc
    return payload, collector


# -- explicit sources: a skeleton and a flat list of tensors --------------------------------


@dataclass(frozen=True)
class StagingPart:
    """What an explicit source hands staging. The worker gets the object back as
    ``rebuild(*args, tensors)``, ``tensors`` rebuilt over the arena (detached), in this order.

    ``key``: an object that stays the same while the tensors' descriptions do (the DCP flow's
    per-plan skeleton), so that a save with the same key re-checks only where the bytes lie;
    ``checked``: the key also vouches for every tensor's dtype, shape and bits (else they are
    checked too, :class:`._structure.TensorCheck`).
    """

    rebuild: Callable[..., Any]
    args: tuple
    tensors: list[torch.Tensor]
    key: object
    checked: bool
    # The part with every per-tensor check of its source, if ``tensors`` skipped them: used
    # unless the cache hits, as a layout equal to a full staging's implies those checks.
    full: Callable[[], StagingPart] | None = None


class StagingSource:
    """A request argument that hands staging explicit data (:meth:`staging_part`) instead of
    being pickled; pickled by anything else it is the object the worker would rebuild."""

    def staging_part(self) -> StagingPart:
        raise NotImplementedError


def request_sources(request: Any) -> list[StagingSource]:
    """The explicit sources among a ``(async_fn, args, kwargs, preload_fn)`` request's
    positional arguments."""
    if type(request) is not tuple or len(request) != 4 or type(request[1]) not in (tuple, list):
        return []
    return [arg for arg in request[1] if isinstance(arg, StagingSource)]


def rebuild_parts(descriptors: bytes, calls: list[tuple[Callable[..., Any], tuple, int]]) -> list:
    """Worker side: each explicit source's object, rebuilt over the arena."""
    tensors = rebuild_batch(descriptors)
    built = []
    start = 0
    for rebuild, args, count in calls:
        built.append(rebuild(*args, tensors[start : start + count]))
        start += count
    return built


def _itself(obj: Any, tensors: list) -> Any:
    return obj


class _ByValue(Exception):
    """An explicit source's tensor must be pickled by value: stage the request generically."""


@dataclass
class _Explicit:
    """One staging's explicit sources: their parts, tensors and the pickle's persistent ids."""

    sources: list[StagingSource]
    parts: list[StagingPart]
    tensors: list[torch.Tensor]
    ids: dict[int, int]

    @classmethod
    def of(cls, sources: list[StagingSource]) -> _Explicit:
        unique: list[StagingSource] = []
        ids: dict[int, int] = {}
        for source in sources:
            if id(source) not in ids:
                ids[id(source)] = len(unique)
                unique.append(source)
        parts = [source.staging_part() for source in unique]
        tensors = [t for part in parts for t in part.tensors]
        return cls(unique, parts, tensors, ids)

    def full(self) -> _Explicit:
        """The parts with every check (for a full staging)."""
        if all(part.full is None for part in self.parts):
            return self
        parts = [part if part.full is None else part.full() for part in self.parts]
        tensors = [t for part in parts for t in part.tensors]
        return _Explicit(self.sources, parts, tensors, self.ids)

    def by_value(self) -> _Explicit:
        """The same sources, each pickled as the object it stands for (its tensors included,
        through the reducers): for a tensor that cannot be described."""
        parts = [StagingPart(_itself, (source,), [], None, False) for source in self.sources]
        return _Explicit(self.sources, parts, [], self.ids)

    @property
    def key(self) -> tuple:
        return tuple(part.key for part in self.parts)

    @property
    def checked(self) -> bool:
        return all(part.checked for part in self.parts)

    def header(self, descriptors: bytes) -> tuple:
        return (descriptors, [(part.rebuild, part.args, len(part.tensors)) for part in self.parts])

    def dump(
        self, obj: Any, descriptors: bytes, what: str, collector: _Collector | None = None
    ) -> tuple[bytes, _Collector]:
        return collect_descriptors(obj, what, self.header(descriptors), self.ids, collector)

    def describe(self, collector: _Collector) -> bytes:
        """The tensors' descriptors (slots in ``collector``), as one blob."""
        if not all(map(_stageable, self.tensors)):
            raise _ByValue
        collector.tensors.extend(self.tensors)
        described = [collector._describe(t, detached=True) for t in self.tensors]
        return pickle.dumps(described, protocol=pickle.HIGHEST_PROTOCOL)


def _layout(slots: list[_PendingSlot]) -> tuple[Placement, tuple[Slot, ...]]:
    """Place ``slots`` in an arena (setting their offsets); the placement and slot table."""
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
    """Copy each pending storage into its slot, the only trainer-side data copy: host storages by
    memmove runs, device storages with ``copy_`` after ``order`` (:mod:`._copy`).
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
    sources: list[StagingSource] | None = None,
) -> StagedRequest:
    """Pickle ``obj`` and copy its tensors into an arena from ``pool``.

    ``sources`` (:func:`request_sources`): arguments that hand their tensors explicitly; with
    ``cache``, a save whose sources have the previous save's keys and layout reuses its
    descriptors and copy plan. Without sources, ``cache`` lets a request laid out like the
    previous one reuse them (:class:`._structure.StageCache`). Otherwise it is staged fully
    and the cache rebuilt. ``order``: the save call's place in the CUDA streams, for
    overlapped staging.
    """
    if sources:
        explicit = _Explicit.of(sources)
        return _stage_explicit(obj, explicit, pool, wait_for_release, what, threads, cache, order)
    if cache is not None:
        guessed = cache.try_pickle(obj, dump_with, threads)
        if guessed is not None:
            payload, tensors = guessed
            return _copy_cached(payload, cache, pool, wait_for_release, tensors, order)
    payload, collector = collect_descriptors(obj, what)
    return _stage_full(payload, collector, pool, wait_for_release, threads, cache, order)


def _copy_cached(
    payload: bytes,
    cache: StageCache,
    pool: ArenaPool,
    wait_for_release: Callable[[], bool],
    tensors: list[torch.Tensor],
    order: DeviceOrder | None,
) -> StagedRequest:
    if not cache.slots:
        return StagedRequest(payload, None, (), 0)
    arena = cache.copy(pool, wait_for_release, tensors, order=order)
    return StagedRequest(payload, arena, cache.slots, cache.total)


def _stage_explicit(
    obj: Any,
    explicit: _Explicit,
    pool: ArenaPool,
    wait_for_release: Callable[[], bool],
    what: str,
    threads: int,
    cache: StageCache | None,
    order: DeviceOrder | None,
) -> StagedRequest:
    """Stage ``obj`` with its explicit sources (by value if a tensor cannot be described)."""
    if cache is not None:
        descriptors = cache.explicit_hit(explicit.key, explicit.tensors, threads, explicit.checked)
        if descriptors is not None:
            payload, rest = explicit.dump(obj, descriptors, what)
            if not rest.tensors:  # nothing else in the request to stage
                return _copy_cached(payload, cache, pool, wait_for_release, explicit.tensors, order)
    explicit = explicit.full()
    collector = _Collector()
    try:
        descriptors = explicit.describe(collector)
    except _ByValue:
        explicit = explicit.by_value()
        collector = _Collector()
        descriptors = explicit.describe(collector)
    payload, collector = explicit.dump(obj, descriptors, what, collector)
    remember = None
    if cache is not None:
        remember = functools.partial(
            cache.remember_explicit,
            explicit.key,
            explicit.checked,
            descriptors,
            reusable=bool(explicit.tensors)
            and collector.reusable
            and len(collector.tensors) == len(explicit.tensors),
        )
    return _stage_full(payload, collector, pool, wait_for_release, threads, cache, order, remember)


def _stage_full(
    payload: bytes,
    collector: _Collector,
    pool: ArenaPool,
    wait_for_release: Callable[[], bool],
    threads: int,
    cache: StageCache | None,
    order: DeviceOrder | None,
    remember: Callable[..., None] | None = None,
) -> StagedRequest:
    """Place ``collector``'s slots, remember the plan in ``cache`` and copy."""
    placement, slots = _layout(collector.slots)
    total = placement.total
    device = _device_plan(collector, slots)
    if cache is not None:
        if remember is None:
            _remember(cache, collector, slots, placement, device, threads)
        else:
            remember(collector.tensors, slots, list(placement.runs), device, total, threads)
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
    obj: Any,
    cache: StageCache,
    threads: int,
    what: str = "the warm-up state",
    sources: list[StagingSource] | None = None,
) -> tuple[int, list[torch.Tensor]]:
    """Fill ``cache`` as a full staging of ``obj`` would, copying nothing; the arena bytes needed
    and the tensors in the cache's order. A later request with the same tensors laid out alike
    then takes the fast path from its first save.
    """
    if sources:
        explicit = _Explicit.of(sources).full()
        collector = _Collector()
        try:
            descriptors = explicit.describe(collector)
        except _ByValue:
            cache.clear()
            return 0, []
        else:
            _, collector = explicit.dump(obj, descriptors, what, collector)
            placement, slots = _layout(collector.slots)
            cache.remember_explicit(
                explicit.key,
                explicit.checked,
                descriptors,
                collector.tensors,
                slots,
                list(placement.runs),
                _device_plan(collector, slots),
                placement.total,
                threads,
                reusable=collector.reusable and len(collector.tensors) == len(explicit.tensors),
                counted=False,
            )
            return placement.total, collector.tensors
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
        unpickler = MainAwareUnpickler(io.BytesIO(payload))
        header = unpickler.load()
        if header is not None:  # the explicit sources, named in the request by index
            unpickler.persistent_load = rebuild_parts(*header).__getitem__  # type: ignore[method-assign]
        obj = unpickler.load()
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
    """``fn()`` on the staging thread, after every background staging submitted before it, so that
    deferred planning's collectives run in staging order, the same on every rank.
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
        """The staged request and the staging's seconds; raises what the staging raised, or
        :class:`CheckpointTimeoutError` after ``timeout``.
        """
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
        """Give up this snapshot; its arena goes back through ``release`` once nothing writes it.
        ``timeout``: how long to wait for the staging here (None: not at all).
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


class PlanStep:
    """The planning of a save made with ``defer_planning=True``: its request's ``preload_fn``.

    ``plan()`` plans the save and returns the write's items, the request's
    ``async_fn_args[1]``; ``preload(items)`` is the preload of those items. Where the request
    is staged (the persistent queue) the staging thread runs the planning first
    (:meth:`planned`), and the request is staged as a planned one; called as a ``preload_fn``
    in the trainer (the fork queue, ``execute_sync``), it plans, then preloads.

    The planning runs once, on the staging thread after every staging submitted before it: a
    failure is kept and raised by every later call, since running its collectives again on
    one rank alone would leave that rank waiting for the others. Unplanned, it has nothing
    to send to a worker, so it refuses to pickle.
    """

    def __init__(self, plan: Callable[[], list], preload: Callable[[list], Any], what: str) -> None:
        self._plan = plan
        self.preload = preload
        self.what = what
        self._items: list | None = None
        self._error: BaseException | None = None

    @property
    def items(self) -> list | None:
        """The planned items; None until the planning ran."""
        return self._items

    def run(self) -> list:
        """The planned items, the planning run first if it has not run."""
        if self._items is not None:
            return self._items
        return in_staging_order(self._run_here)

    def _run_here(self) -> list:
        if self._items is not None:
            return self._items
        if self._error is not None:
            raise InvalidRequestError(
                f"the deferred planning of {self.what} failed before: {self._error}"
            ) from self._error
        try:
            self._items = self._plan()
        except BaseException as exc:
            self._error = exc
            raise
        return self._items

    def __call__(self) -> Any:
        return self.preload(self.run())

    def planned(self, args: tuple | list) -> tuple[tuple, Callable[[], Any]]:
        """``(async_fn_args, preload_fn)`` of the planned request: the items in ``args[1]``,
        the preload bound to them."""
        items = self.run()
        return (args[0], items, *args[2:]), functools.partial(self.preload, items)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise InvalidRequestError(
            f"{self.what} was made with defer_planning=True and its planning is its request's "
            "preload_fn: schedule the request on an AsyncCallsQueue (its staging plans it) or "
            "call the preload_fn"
        )
