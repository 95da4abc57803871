"""Staging: a request's tensors snapshotted into reusable shared memory, and back out.

Decision: the trainer copies every tensor reachable from a request (``async_fn``, arguments,
``preload_fn``, however deeply nested) into an *arena*, one ``memfd`` region mapped by trainer
and worker (:mod:`._arena`). When ``schedule_async_request`` returns the checkpoint content is
fixed and training may change its tensors. Arenas are pooled and reused for every save whose
bytes fit, so in steady state no segment is created per save and host memory does not grow.

Trainer side: staging takes a *skeleton* and a *flat list of tensors*. Each tensor becomes a
descriptor (slot, dtype, size, stride, offset), all of them one blob; slots are keyed by
*storage*, so views and tied weights stay shared exactly as ``torch.save`` would see them.
:mod:`._copy` fills the slots; :class:`._structure.StageCache` lets a save whose tensors are
laid out as the previous one's reuse its descriptors and copy plan. The payload is two
pickles: the header (the descriptors and the explicit sources' rebuild calls), then the
skeleton. Worker side, :func:`unstage` rebuilds every tensor over its slot, then the
explicit sources, then the skeleton.

* **Explicit sources.** A request argument that is a :class:`StagingSource` (the async DCP
  writer's payload, a local shard's layout) is not pickled: it hands staging a
  :class:`StagingPart`, a rebuild call, its arguments and a flat list of tensors, with a key
  (the plan it was made from) that tells a steady save from another one. The skeleton names
  it by index (``persistent_id``, set only for such requests, whose other objects are few).
* **Anything else** (a ``torch.save`` state, a user's request) is pickled with one
  ``dispatch_table`` reducer that appends each strided CPU or CUDA tensor to the flat list
  and pickles its index (:class:`_Reducer`). The C pickler consults the table only for
  tensor types, so the cost is one Python call per tensor; a ``persistent_id`` method would
  be called for every object pickled. Pickle memoizes each reduced tensor, so a tensor met
  twice is one entry and one object again in the worker.

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
from ._structure import StageCache

logger = get_logger(__name__)


# -- trainer side: a request as a skeleton and a flat list of tensors ------------------------


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


class _Reducer:
    """The request pickle's one reducer: a stageable tensor becomes its index in the flat list
    (appended on first meeting; pickle memoizes it, so a tensor met twice is one index and one
    object again in the worker); any other tensor goes by value, through torch's reducer.

    ``checked=False`` (a steady save's pickle) takes every tensor as stageable: that pickle
    stands only if its tensors are described as a full staging's, which implies it."""

    __slots__ = ("checked", "tensors")

    def __init__(self, tensors: list[torch.Tensor], checked: bool) -> None:
        self.tensors = tensors
        self.checked = checked

    def __call__(self, obj: torch.Tensor) -> Any:
        if self.checked and not _stageable(obj):
            return obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        tensors = self.tensors
        tensors.append(obj)
        return _staged_tensor, (len(tensors) - 1,)


def _pickle_skeleton(
    obj: Any,
    tensors: list[torch.Tensor],
    explicit: dict[int, int],
    what: str,
    *,
    checked: bool = True,
) -> bytes:
    """``obj`` pickled with its tensors as indices into ``tensors`` (which it extends), and the
    objects whose id is in ``explicit`` as that source's index; raises naming ``what``.
    ``checked``: see :class:`_Reducer`."""
    table: dict[type, Any] = dict(copyreg.dispatch_table)
    table[torch.Tensor] = table[torch.nn.Parameter] = _Reducer(tensors, checked)
    table[types.ModuleType] = _reduce_module
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = table
    if explicit:
        pickler.persistent_id = lambda o: explicit.get(id(o))  # type: ignore[method-assign]
    try:
        pickler.dump(obj)
    except CheckpointingException:
        raise  # ours (e.g. a write item resolved late to a non-tensor) say what happened
    except Exception as exc:
        raise InvalidRequestError(
            f"{what} cannot be sent to the background worker: {type(exc).__name__}: {exc}. "
            "Use module-level functions (not lambdas or local functions) and picklable "
            "arguments, or functools.partial of them."
        ) from exc
    return buf.getvalue()


@dataclass
class _Slots:
    """The storages of a flat list of tensors, by identity, in order of first use, and each
    tensor's descriptor (``rebuild_staged``'s arguments) over them."""

    pending: list[_PendingSlot]
    slot_of: dict[StorageKey, int]
    descriptors: bytes

    @classmethod
    def of(cls, tensors: list[torch.Tensor], detached: int) -> _Slots:
        """``detached``: how many of the first tensors are rebuilt detached (the explicit
        sources')."""
        pending: list[_PendingSlot] = []
        slot_of: dict[StorageKey, int] = {}
        described = []
        for index, tensor in enumerate(tensors):
            storage = tensor.untyped_storage()
            key = storage_key(storage)
            nbytes = key[2]
            slot = slot_of.get(key)
            if slot is None or nbytes == 0:
                slot = len(pending)
                pending.append(_PendingSlot(storage, nbytes, _copy.is_host(storage)))
                slot_of[key] = slot
            kept = index >= detached
            described.append(
                (
                    slot,
                    tensor.dtype,
                    tuple(tensor.size()),
                    tensor.stride(),
                    tensor.storage_offset(),
                    tensor.requires_grad and kept,
                    type(tensor) is torch.nn.Parameter and kept,
                )
            )
        return cls(pending, slot_of, pickle.dumps(described, protocol=pickle.HIGHEST_PROTOCOL))


@dataclass
class StagedRequest:
    """A pickled request and the arena its tensors' bytes were copied into."""

    payload: bytes
    arena: Arena | None
    slots: tuple[Slot, ...]
    nbytes: int


# -- explicit sources: a skeleton and a flat list of tensors --------------------------------


@dataclass(frozen=True)
class StagingPart:
    """What an explicit source hands staging. The worker gets the object back as
    ``rebuild(*args, tensors)``, ``tensors`` rebuilt over the arena (detached), in this order.

    ``key``: an object that stays the same while the tensors' descriptions do (the DCP flow's
    per-plan skeleton, the local flow's plan generation), so that a save with the same key
    re-checks only where the bytes lie; ``checked``: the key also vouches for every tensor's
    dtype, shape and bits (else they are checked too, :class:`._structure.TensorCheck`).
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


def request_sources(obj: Any) -> list[StagingSource]:
    """The explicit sources of a request ``(async_fn, args, kwargs, preload_fn)``: its
    positional arguments that are one, or lists or tuples of them (a warm-up's state: ``obj``
    itself, or its elements)."""
    if type(obj) is tuple and len(obj) == 4 and type(obj[1]) in (tuple, list):
        obj = obj[1]
    elif isinstance(obj, StagingSource):
        return [obj]
    if type(obj) not in (tuple, list):
        return []
    found = []
    for arg in obj:
        if isinstance(arg, StagingSource):
            found.append(arg)
        elif type(arg) in (tuple, list) and arg and isinstance(arg[0], StagingSource):
            found.extend(source for source in arg if isinstance(source, StagingSource))
    return found


def rebuild_parts(
    tensors: list[torch.Tensor], calls: list[tuple[Callable[..., Any], tuple, int]]
) -> list:
    """Worker side: each explicit source's object, rebuilt over the arena."""
    built = []
    start = 0
    for rebuild, args, count in calls:
        built.append(rebuild(*args, tensors[start : start + count]))
        start += count
    return built


@dataclass
class _Explicit:
    """One staging's explicit sources: their parts, tensors and the pickle's persistent ids."""

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
        return cls(parts, [t for part in parts for t in part.tensors], ids)

    def full(self) -> _Explicit:
        """The parts with every check (for a full staging); none if a tensor cannot be
        described, the sources then pickled as the objects they stand for (their tensors
        through the reducer, by value where needed)."""
        if all(part.full is None for part in self.parts):
            parts = self.parts
        else:
            parts = [part if part.full is None else part.full() for part in self.parts]
        tensors = [t for part in parts for t in part.tensors]
        if not all(map(_stageable, tensors)):
            return _Explicit([], [], {})
        if parts is self.parts:
            return self
        return _Explicit(parts, tensors, self.ids)

    @property
    def key(self) -> tuple:
        return tuple(part.key for part in self.parts)

    def checked(self, tensors: list[torch.Tensor]) -> bool:
        """Whether the keys vouch for the description of every one of ``tensors``."""
        return len(tensors) == len(self.tensors) and all(part.checked for part in self.parts)

    def header(self, descriptors: bytes) -> bytes:
        """What the worker unpickles first: the tensors' descriptors and the parts' rebuilds."""
        calls = [(part.rebuild, part.args, len(part.tensors)) for part in self.parts]
        return pickle.dumps((descriptors, calls), protocol=pickle.HIGHEST_PROTOCOL)


def _framed(header: bytes, skeleton: bytes) -> bytes:
    return b"".join((len(header).to_bytes(8, "little"), header, skeleton))


@dataclass
class _Plan:
    """A full staging's plan: the request pickled, its tensors, their slots and placement."""

    explicit: _Explicit
    skeleton: bytes
    tensors: list[torch.Tensor]
    slots: _Slots
    placement: Placement
    table: tuple[Slot, ...]
    device: DevicePlan

    @classmethod
    def of(
        cls,
        obj: Any,
        explicit: _Explicit,
        what: str,
        pickled: tuple[bytes, list[torch.Tensor]] | None = None,
    ) -> _Plan:
        """``pickled``: a steady save's pickle of ``obj`` with ``explicit`` (skeleton, tensors),
        reused when it is what the checked pickle would make (every tensor stageable)."""
        full = explicit.full()
        if (
            pickled is not None
            and full is explicit
            and all(map(_stageable, pickled[1][len(explicit.tensors) :]))
        ):
            skeleton, tensors = pickled
        else:
            tensors = list(full.tensors)
            skeleton = _pickle_skeleton(obj, tensors, full.ids, what)
        explicit = full
        slots = _Slots.of(tensors, len(explicit.tensors))
        pending = slots.pending
        placement = place([(p.storage.data_ptr() if p.host else None, p.nbytes) for p in pending])
        table = SlotTable(zip(placement.offsets, (p.nbytes for p in pending), strict=True))
        host = [p.host for p in pending]
        device = NO_DEVICE if all(host) else plan_device_copies(tensors, slots.slot_of, table, host)
        return cls(explicit, skeleton, tensors, slots, placement, table, device)

    def remember(self, cache: StageCache, threads: int, *, counted: bool = True) -> None:
        cache.remember(
            self.explicit.key,
            self.explicit.checked(self.tensors),
            self.slots.descriptors,
            self.tensors,
            self.table,
            list(self.placement.runs),
            self.device,
            self.placement.total,
            threads,
            counted=counted,
        )

    @property
    def payload(self) -> bytes:
        return _framed(self.explicit.header(self.slots.descriptors), self.skeleton)


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

    ``sources`` (:func:`request_sources`): arguments that hand their tensors explicitly. With
    ``cache``, a save whose tensors (the sources' and those the pickle met, in order) are laid
    out as at the previous save, with the sources' keys of then, reuses that staging's
    descriptors and copy plan (:class:`._structure.StageCache`); otherwise it is staged fully
    and the cache rebuilt. ``order``: the save call's place in the CUDA streams, for
    overlapped staging.
    """
    explicit = _Explicit.of(sources or [])
    pickled = None
    if cache is not None and cache.kept:
        tensors = list(explicit.tensors)
        skeleton = _pickle_skeleton(obj, tensors, explicit.ids, what, checked=False)
        descriptors = cache.hit(explicit.key, tensors, threads, explicit.checked(tensors))
        if descriptors is not None:
            payload = _framed(explicit.header(descriptors), skeleton)
            if not cache.slots:
                return StagedRequest(payload, None, (), 0)
            arena = cache.copy(pool, wait_for_release, tensors, order=order)
            return StagedRequest(payload, arena, cache.slots, cache.total)
        pickled = (skeleton, tensors)
    plan = _Plan.of(obj, explicit, what, pickled)
    if cache is not None:
        plan.remember(cache, threads)
    if not plan.table:
        return StagedRequest(plan.payload, None, (), 0)
    if cache is not None and cache.planned_for(plan.table):
        # Copy with the plan just cached, not a second coalesce/split.
        arena = cache.copy(pool, wait_for_release, plan.tensors, order=order)
    else:
        arena = pool.acquire(plan.placement.total, wait_for_release)
        try:
            copy_into(
                arena, plan.placement, plan.device, plan.tensors, threads=threads, order=order
            )
        except BaseException:
            pool.release(arena.arena_id)
            raise
    return StagedRequest(plan.payload, arena, plan.table, plan.placement.total)


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
    plan = _Plan.of(obj, _Explicit.of(sources or []), what)
    plan.remember(cache, threads, counted=False)
    return plan.placement.total, plan.tensors


# -- worker side: a staged request unpickled over its arena -----------------------------------


class _UnstageContext(threading.local):
    arena: Arena | None = None
    slots: tuple[Slot, ...] = ()
    storages: dict[int, torch.UntypedStorage] | None = None
    tensors: list[torch.Tensor] = []


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


def _staged_tensor(index: int) -> torch.Tensor:
    """Worker side: the request's ``index``-th tensor, rebuilt over the arena."""
    tensors = _unstaging.tensors
    if index >= len(tensors):
        raise StagingError("a staged tensor was unpickled outside of unstage()")
    return tensors[index]


def unstage(payload: bytes, arena: Arena | None, slots: tuple[Slot, ...]) -> Any:
    """Worker side: unpickle a staged request; its tensors view ``arena``."""
    view = memoryview(payload)
    end = 8 + int.from_bytes(view[:8], "little")
    _unstaging.arena, _unstaging.slots, _unstaging.storages = arena, slots, {}
    try:
        descriptors, calls = pickle.loads(view[8:end])
        tensors = [rebuild_staged(*args) for args in pickle.loads(descriptors)]
        _unstaging.tensors = tensors
        # Finds the trainer's __main__ names, importing that module only if asked to.
        unpickler = MainAwareUnpickler(io.BytesIO(view[end:]))
        if calls:  # the explicit sources, named in the request by index
            unpickler.persistent_load = rebuild_parts(tensors, calls).__getitem__  # type: ignore[method-assign]
        obj = unpickler.load()
    except BaseException:
        pending_sparse_tensors().clear()
        raise
    finally:
        _unstaging.arena, _unstaging.slots, _unstaging.storages = None, (), None
        _unstaging.tensors = []
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
