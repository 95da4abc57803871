"""Snapshotting a request's tensors into reusable shared memory.

Decision: the trainer copies every tensor reachable from a request (its ``async_fn``,
arguments, keyword arguments and ``preload_fn``, however deeply nested, inside dataclasses
and partials too) into an *arena*: one ``memfd`` shared-memory region mapped by both the
trainer and its worker. When ``schedule_async_request`` returns, the checkpoint content is
fixed; training may change its tensors at once.

How: the request is pickled once with a :class:`pickle.Pickler` whose ``persistent_id``
replaces each strided CPU or CUDA tensor with a small descriptor (slot, dtype, size,
stride, offset). Tensors are grouped by *storage*, so views and tied weights stay shared
exactly as ``torch.save`` would see them. The slots are then laid out in the arena and
filled with one ``copy_`` each (device-to-host for CUDA). In the worker an unpickler turns
each descriptor back into a tensor whose storage is exactly its slot of the arena.

Alternatives rejected:

* ``torch.multiprocessing`` queues move CPU tensors into shared memory *in place*
  (``share_memory_``): the trainer's own tensors would alias the checkpoint, and each save
  would make new segments.
* ``multiprocessing.shared_memory`` leaves named files in ``/dev/shm`` when a process is
  killed and registers with a resource tracker. A ``memfd`` has no name and disappears when
  the last process holding it exits, so a SIGKILL leaves nothing behind.

Arenas are kept in a small pool and reused for every save whose bytes fit, so in steady
state no segment is created per save and host memory does not grow.
"""

from __future__ import annotations

import copyreg
import importlib
import io
import itertools
import mmap
import os
import pickle
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .._logging import get_logger
from ..errors import CheckpointTimeoutError, InvalidRequestError, StagingError
from ._copy import CopyJob, start_copy
from ._messages import Slot

logger = get_logger(__name__)

_ALIGN = 64
_arena_ids = itertools.count(1)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class Arena:
    """One anonymous shared-memory region (a memfd), mapped read-write."""

    def __init__(
        self,
        nbytes: int,
        *,
        arena_id: int | None = None,
        fd: int | None = None,
        populate: bool = True,
    ) -> None:
        self.arena_id = arena_id if arena_id is not None else next(_arena_ids)
        self.nbytes = max(int(nbytes), _ALIGN)
        owns_fd = fd is None
        if fd is None:
            fd = os.memfd_create(f"resilient_ckpt_arena_{self.arena_id}", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, self.nbytes)
            except OSError:
                os.close(fd)
                raise
        self.fd = fd
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        try:
            self._mm: mmap.mmap | None = mmap.mmap(fd, self.nbytes, flags=flags)
        except OSError:
            if owns_fd:
                os.close(fd)
            raise
        self.pinned = False
        # One long-lived view gives the base address for memmove (and keeps the export).
        self._base: torch.Tensor | None = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.address = self._base.data_ptr()

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor whose storage is exactly ``[offset, offset+nbytes)``."""
        if self._mm is None:
            raise StagingError(f"arena {self.arena_id} is closed")
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self._mm, dtype=torch.uint8, count=nbytes, offset=offset)

    def pin(self) -> None:
        """Page-lock the arena for fast asynchronous device-to-host copies (CUDA only)."""
        if self.pinned or not torch.cuda.is_available():
            return
        base = self.view(0, self.nbytes)
        err = torch.cuda.cudart().cudaHostRegister(base.data_ptr(), self.nbytes, 0)
        self.pinned = int(err) == 0
        if not self.pinned:
            logger.warning(
                "could not pin staging arena (%d bytes): cuda error %s", self.nbytes, err
            )

    def close(self) -> None:
        if self._mm is None:
            return
        if self.pinned:
            base = self.view(0, self.nbytes)
            torch.cuda.cudart().cudaHostUnregister(base.data_ptr())
            del base
            self.pinned = False
        self._base = None
        try:
            self._mm.close()
        except BufferError:
            # A tensor still views the mapping; it is unmapped when that tensor dies.
            logger.debug("arena %d still referenced at close", self.arena_id)
        self._mm = None
        try:
            os.close(self.fd)
        except OSError:
            pass


@dataclass
class _PendingSlot:
    storage: torch.UntypedStorage
    nbytes: int
    offset: int = 0


def _reduce_module(module: types.ModuleType) -> Any:
    # Modules (e.g. torch.save's pickle_module=pickle) travel by name.
    return importlib.import_module, (module.__name__,)


class _Collector:
    """Per-pickle state: the storages met so far, by identity, in order of first use."""

    def __init__(self) -> None:
        self.slots: list[_PendingSlot] = []
        self._slot_of: dict[tuple[str, int, int], int] = {}

    def reduce_tensor(self, obj: torch.Tensor) -> Any:
        if obj.layout != torch.strided or obj.device.type == "meta" or obj.is_quantized:
            return obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        storage = obj.untyped_storage()
        nbytes = storage.nbytes()
        key = (storage.device.type, storage.data_ptr(), nbytes)
        slot = self._slot_of.get(key)
        if slot is None or nbytes == 0:
            slot = len(self.slots)
            self.slots.append(_PendingSlot(storage, nbytes))
            self._slot_of[key] = slot
        return _rebuild_staged, (
            slot,
            obj.dtype,
            tuple(obj.size()),
            obj.stride(),
            obj.storage_offset(),
            obj.requires_grad,
            type(obj) is torch.nn.Parameter,
        )


def _dispatch_table(collector: _Collector) -> dict[type, Any]:
    """Tensors become arena descriptors; found by a type lookup inside the C pickler.

    A ``persistent_id`` method would be a Python call for *every* object pickled (about 75
    per DCP write item); the dispatch table costs one call per tensor only. Pickle memoizes
    the reduced tensor, so a tensor met twice is rebuilt once (identity preserved), and
    tensors sharing a storage share one slot (views and tied weights stay shared).
    """
    table: dict[type, Any] = dict(copyreg.dispatch_table)
    table[torch.Tensor] = collector.reduce_tensor
    table[torch.nn.Parameter] = collector.reduce_tensor
    table[types.ModuleType] = _reduce_module
    return table


class _UnstageContext(threading.local):
    arena: Arena | None = None
    slots: tuple[Slot, ...] = ()
    storages: dict[int, torch.UntypedStorage] | None = None


_unstaging = _UnstageContext()


def _rebuild_staged(
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
        where = _unstaging.slots[slot]
        storage = arena.view(where.offset, where.nbytes).untyped_storage()
        storages[slot] = storage
    tensor = torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)
    if is_param:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor


@dataclass
class StagedRequest:
    """A pickled request and where its tensors' bytes are (or are being) copied.

    ``copy`` is ``None`` once every byte is in the arena; in overlapped mode it is the copy
    still running, and the request must not be submitted before ``copy.wait()``.
    """

    payload: bytes
    arena: Arena | None
    slots: tuple[Slot, ...]
    nbytes: int
    copy: CopyJob | None = None


def pickle_with_descriptors(obj: Any, what: str) -> tuple[bytes, list[_PendingSlot]]:
    """Pickle ``obj`` with tensors replaced by descriptors; name ``what`` on failure."""
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    collector = _Collector()
    pickler.dispatch_table = _dispatch_table(collector)
    try:
        pickler.dump(obj)
    except Exception as exc:
        raise InvalidRequestError(
            f"{what} cannot be sent to the background worker: {type(exc).__name__}: {exc}. "
            "Use module-level functions (not lambdas or local functions) and picklable "
            "arguments, or functools.partial of them."
        ) from exc
    return buf.getvalue(), collector.slots


def _layout(slots: list[_PendingSlot]) -> int:
    offset = 0
    for slot in slots:
        slot.offset = offset
        offset += _align(slot.nbytes)
    return offset


def copy_into(
    arena: Arena, slots: list[_PendingSlot], *, threads: int = 1, overlap: bool = False
) -> CopyJob:
    """Copy each pending storage into its arena slot (the only trainer-side data copy).

    Host storages are copied by :func:`._copy.start_copy` (memmove, coalesced, ``threads``
    threads); device storages with ``copy_``. See there for ``overlap``.
    """
    base = arena.address
    host: list[tuple[int, int, int]] = []
    device: list[tuple[torch.Tensor, torch.Tensor]] = []
    keepalive: list[Any] = []
    for slot in slots:
        if slot.nbytes == 0:
            continue
        storage = slot.storage
        if storage.device.type == "cpu":
            host.append((base + slot.offset, storage.data_ptr(), slot.nbytes))
            keepalive.append(storage)
        else:
            src = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            device.append((arena.view(slot.offset, slot.nbytes), src))
    return start_copy(
        host,
        threads=threads,
        overlap=overlap,
        keepalive=keepalive,
        device_copies=device,
        non_blocking=arena.pinned,
    )


def unstage(payload: bytes, arena: Arena | None, slots: tuple[Slot, ...]) -> Any:
    """Worker side: unpickle a staged request; its tensors view ``arena``."""
    _unstaging.arena, _unstaging.slots, _unstaging.storages = arena, slots, {}
    try:
        return pickle.loads(payload)
    finally:
        _unstaging.arena, _unstaging.slots, _unstaging.storages = None, (), None


class ArenaPool:
    """At most ``max_arenas`` arenas; a free one that fits is reused, else one is made.

    ``acquire`` waits (through ``wait_for_release``) when every arena is busy, so host
    memory stays bounded by ``max_arenas`` times the largest staged state.
    """

    def __init__(self, max_arenas: int = 2) -> None:
        if max_arenas < 1:
            raise InvalidRequestError(f"max_arenas must be >= 1, got {max_arenas}")
        self.max_arenas = max_arenas
        self.free: list[Arena] = []
        self.busy: dict[int, Arena] = {}
        self.created = 0
        self.replaced = 0
        self._lock = threading.Lock()

    def acquire(self, nbytes: int, wait_for_release: Callable[[], bool]) -> Arena:
        while True:
            with self._lock:
                fitting = [a for a in self.free if a.nbytes >= nbytes]
                if fitting:
                    arena = min(fitting, key=lambda a: a.nbytes)
                    self.free.remove(arena)
                    self.busy[arena.arena_id] = arena
                    return arena
                # Every idle arena is too small for this state (its structure grew): replace
                # them rather than keep memory that no save of this size can use.
                for small in self.free:
                    small.close()
                    self.replaced += 1
                self.free.clear()
                if len(self.free) + len(self.busy) < self.max_arenas:
                    arena = self._create(nbytes)
                    self.busy[arena.arena_id] = arena
                    return arena
            if not wait_for_release():
                raise CheckpointTimeoutError(
                    f"all {self.max_arenas} staging arenas stayed busy past the deadline; "
                    "earlier requests are still being written"
                )

    def _create(self, nbytes: int) -> Arena:
        try:
            arena = Arena(nbytes)
        except OSError as exc:
            raise StagingError(
                f"could not allocate {nbytes} bytes of shared staging memory: {exc}"
            ) from exc
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            arena.pin()
        self.created += 1
        logger.debug("created staging arena %d (%d bytes)", arena.arena_id, arena.nbytes)
        return arena

    def live_ids(self) -> set[int]:
        """Ids of the arenas that exist (free or busy); others were closed or replaced."""
        with self._lock:
            return {a.arena_id for a in self.free} | set(self.busy)

    def release(self, arena_id: int) -> None:
        with self._lock:
            arena = self.busy.pop(arena_id, None)
            if arena is not None:
                self.free.append(arena)

    def release_all(self) -> None:
        with self._lock:
            self.free.extend(self.busy.values())
            self.busy.clear()

    def close(self) -> None:
        with self._lock:
            for arena in [*self.free, *self.busy.values()]:
                arena.close()
            self.free.clear()
            self.busy.clear()


def stage(
    obj: Any,
    pool: ArenaPool,
    wait_for_release: Callable[[], bool],
    what: str = "the async request",
    *,
    threads: int = 1,
    overlap: bool = False,
) -> StagedRequest:
    """Pickle ``obj`` and copy its tensors into an arena from ``pool``.

    With ``overlap`` the copy may still be running when this returns (``StagedRequest.copy``).
    """
    payload, pending = pickle_with_descriptors(obj, what)
    total = _layout(pending)
    if not pending:
        return StagedRequest(payload, None, (), 0)
    arena = pool.acquire(total, wait_for_release)
    try:
        job = copy_into(arena, pending, threads=threads, overlap=overlap)
    except BaseException:
        pool.release(arena.arena_id)
        raise
    slots = tuple(Slot(p.offset, p.nbytes) for p in pending)
    return StagedRequest(payload, arena, slots, total, job if overlap else None)


def tensor_nbytes(obj: Any, what: str = "the state") -> int:
    """Arena bytes ``obj``'s tensors need when staged (for pre-sizing an arena)."""
    _, pending = pickle_with_descriptors(obj, what)
    return _layout(pending)
