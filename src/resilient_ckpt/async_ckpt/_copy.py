"""The copies of a snapshot: where each storage goes in the arena, and how its bytes get there.

:mod:`._staging` decides *what* is copied (one slot per storage); this module decides where
each slot lies in the arena and the copies that fill it, the only trainer-side data copy of
a save. Everything here is a function of the tensors' layouts, so :mod:`._structure` keeps
the plans for the next save of the same layout.

**Placement: host storages close together in memory keep their relative places in the arena
and are copied as one range, gaps included.** Thousands of small tensors allocated one after
another sit in memory separated only by allocator headers; placed back to back, each would
be a copy call of its own, while mirrored, a run of neighbours is one ``memmove`` in address
order.

* A storage joins the run before it if it starts at most ``BRIDGE_MAX_BYTES`` after the
  run's end (or overlaps it) and the gap is at most a sixteenth of the two neighbours' bytes,
  so the arena grows by at most an eighth of the state.
* **Reading a gap is safe**: it is shorter than the smallest page (4 KiB), so each of its
  bytes lies on a page of the storage before or after it, both mapped while the copy keeps
  them alive. Gap bytes are never read back: each rebuilt tensor sees only its own slot.
* A run starts at an arena offset congruent to its source address modulo 64, so every
  storage keeps its alignment. Device and empty storages follow, 64-byte aligned.

**Host copies** are ``ctypes.memmove`` per range, not ``Tensor.copy_``: cheaper per call, and
a foreign call releases the GIL, so copy threads (and, overlapped, the training step) run in
parallel. Above ``PARALLEL_MIN_BYTES`` the ranges are split into equal shares over a
persistent pool, the calling thread taking one; one thread rarely saturates memory
bandwidth. The default is ``min(4, cores / local ranks)`` threads
(``RESILIENT_CKPT_COPY_THREADS`` overrides), so ranks sharing a node do not oversubscribe it.

**Device copies** (``copy_`` into the pinned arena, waited for before the snapshot counts as
taken): a tensor that *is* its storage's bytes in order (the common parameter or optimizer
state) is copied into a view of its slot typed like it; any other storage goes as raw bytes
through a ``uint8`` tensor. The typed views are kept by the arena for the cached plan
(:meth:`._arena.Arena.kept_views`). In overlapped staging the save call records an event on
each device's current stream (:class:`DeviceOrder`) and the staging thread copies on side
streams that wait for it: the copies see the values the call saw, the trainer's stream never
waits for them, and the snapshot never waits for the step queued meanwhile, as a
device-wide synchronize would.

Rejected: coalescing only exactly adjacent storages never merges two CPU allocations (their
chunks carry headers); a native gather of the gap-free bytes needs a compiled extension.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .._torch_compat import cuda_devices_with_context
from ..errors import ConfigurationError, StagingError
from ._arena import Arena
from ._protocol import Slot

# At most this many bytes between two host storages copied as one range; below the 4 KiB
# page of every platform torch runs on (see the module docstring).
BRIDGE_MAX_BYTES = 1024
ALIGN = 64
PARALLEL_MIN_BYTES = 8 << 20
COPY_THREADS_ENV = "RESILIENT_CKPT_COPY_THREADS"

# (destination address, source address, bytes)
Segment = tuple[int, int, int]

# -- placement: each storage's place in the arena ---------------------------------------------


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Placement:
    """``offsets[i]``: storage i's place in an arena of ``total`` bytes; ``runs``: the host copy as
    ``(arena offset, source address, bytes)`` ranges, in address order.
    """

    total: int
    offsets: tuple[int, ...]
    runs: tuple[Segment, ...]


def _bridgeable(gap: int, before: int, after: int) -> bool:
    return gap <= BRIDGE_MAX_BYTES and gap * 16 <= before + after


def place(storages: Sequence[tuple[int | None, int]]) -> Placement:
    """Place storages given as ``(host address, or None for a device storage, bytes)``."""
    offsets = [0] * len(storages)
    host = sorted(
        (address, i, nbytes)
        for i, (address, nbytes) in enumerate(storages)
        if address is not None and nbytes
    )
    runs: list[Segment] = []
    cursor = 0
    start = end = previous = 0
    for address, i, nbytes in host:
        if runs and _bridgeable(address - end, previous, nbytes):
            end = max(end, address + nbytes)
        else:
            if runs:
                runs[-1] = (runs[-1][0], start, end - start)
                cursor = runs[-1][0] + end - start
            start, end = address, address + nbytes
            runs.append((align(cursor) + start % ALIGN, start, 0))
        offsets[i] = runs[-1][0] + address - start
        previous = nbytes
    if runs:
        runs[-1] = (runs[-1][0], start, end - start)
        cursor = runs[-1][0] + end - start
    cursor = align(cursor)
    for i, (where, size) in enumerate(storages):
        if where is None or not size:
            offsets[i] = cursor
            cursor += align(size)
    return Placement(cursor, tuple(offsets), tuple(runs))


# -- host copies: memmove on copy threads ------------------------------------------------------


def default_copy_threads() -> int:
    """Copy threads per rank: the environment override, else ``min(4, cores / local ranks)``."""
    text = os.environ.get(COPY_THREADS_ENV, "").strip()
    if text:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise ConfigurationError(f"{COPY_THREADS_ENV} must be an integer >= 1, got {text!r}")
        return value
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, min(4, cores // local))


def check_copy_threads(threads: int | None) -> int:
    if threads is None:
        return default_copy_threads()
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ConfigurationError(f"copy_threads must be an int >= 1 or None, got {threads!r}")
    return threads


def coalesce(segments: Sequence[Segment]) -> list[Segment]:
    """Merge ranges that are contiguous both in the source and in the arena."""
    merged: list[Segment] = []
    for dst, src, n in segments:
        if n == 0:
            continue
        if merged:
            pdst, psrc, pn = merged[-1]
            if pdst + pn == dst and psrc + pn == src:
                merged[-1] = (pdst, psrc, pn + n)
                continue
        merged.append((dst, src, n))
    return merged


def split_shares(
    segments: Sequence[Segment], shares: int, min_bytes: int | None = None
) -> list[list[Segment]]:
    """Cut ``segments`` into at most ``shares`` lists of nearly equal bytes, in order; one list
    below ``min_bytes`` (default ``PARALLEL_MIN_BYTES``).
    """
    total = sum(n for _, _, n in segments)
    least = PARALLEL_MIN_BYTES if min_bytes is None else min_bytes
    if shares <= 1 or total < max(least, 1):
        return [list(segments)]
    target = -(-total // shares)
    out: list[list[Segment]] = [[]]
    room = target
    for dst, src, n in segments:
        while n > 0:
            if room == 0:
                out.append([])
                room = target
            take = min(n, room)
            out[-1].append((dst, src, take))
            dst, src, n, room = dst + take, src + take, n - take, room - take
    return out


def plan_shares(host: Sequence[Segment], threads: int) -> list[list[Segment]]:
    """The copy work of ``host`` ranges: coalesced, then split over ``threads``."""
    return split_shares(coalesce(host), threads)


def copy_segments(segments: Sequence[Segment], base: int = 0) -> None:
    """``memmove`` each range (destinations relative to ``base``); releases the GIL."""
    move = ctypes.memmove
    for dst, src, n in segments:
        move(base + dst, src, n)


class ThreadPool:
    """A process-wide pool of threads, grown on demand, recreated after a fork."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._size = 0
        self._pid = os.getpid()

    def get(self, size: int) -> ThreadPoolExecutor:
        with self._lock:
            if self._pid != os.getpid():
                self._executor, self._size, self._pid = None, 0, os.getpid()
            if self._executor is None or self._size < size:
                old = self._executor
                self._executor = ThreadPoolExecutor(
                    max_workers=size, thread_name_prefix=self._prefix
                )
                self._size = size
                if old is not None:
                    old.shutdown(wait=False)
                # Start every thread now, not on the first save.
                for future in [self._executor.submit(int) for _ in range(size)]:
                    future.result()
            return self._executor


_POOL = ThreadPool("resilient_ckpt-copy")


def warm_threads(threads: int) -> None:
    """Start the copy threads ahead of the first save (part of the documented warm-up)."""
    if threads > 1:
        _POOL.get(threads)


def copy_all(
    host: Sequence[Segment],
    *,
    threads: int,
    device_wait: Callable[[], None] | None = None,
    shares: list[list[Segment]] | None = None,
    base: int = 0,
) -> None:
    """Copy ``host`` ranges (the caller's thread takes one share, the pool the others), then
    complete the device copies already issued (``device_wait``, from :func:`start_copies`).
    Every byte is in the arena when this returns or raises. ``shares`` (from :func:`plan_shares`,
    relative to ``base``) replaces ``host`` when the plan is known.
    """
    if shares is None:
        shares = plan_shares(host, threads)
    futures = []
    if len(shares) > 1:
        pool = _POOL.get(len(shares) - 1)
        futures = [pool.submit(copy_segments, share, base) for share in shares[1:]]
    errors: list[BaseException] = []
    try:
        copy_segments(shares[0] if shares else [], base)
    except BaseException as exc:
        errors.append(exc)
    for future in futures:
        try:
            future.result()
        except BaseException as exc:
            errors.append(exc)
    if device_wait is not None:
        device_wait()
    if errors:
        raise StagingError(f"copying the snapshot into shared memory failed: {errors[0]!r}")


# -- device copies: copy_ into the pinned arena ------------------------------------------------

StorageKey = tuple[str, int, int]


class DeviceSlot(NamedTuple):
    """A device storage's slot and the request's tensor read to fill it (index ``source``);
    ``whole``: that tensor is the storage's bytes in order.
    """

    offset: int
    nbytes: int
    source: int
    whole: bool


def is_host(storage: torch.UntypedStorage) -> bool:
    """Whether staging copies ``storage`` as host memory (memmove) rather than with ``copy_``."""
    return storage.device.type == "cpu"


class DevicePlan(NamedTuple):
    """A request's device copies, one per non-empty device slot, and the CUDA devices they read.
    Its identity keys the destination views an arena keeps.
    """

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
    """The device copy plan for ``tensors``; per slot, a tensor that is its storage's whole bytes is
    preferred over a view into it.
    """
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


def destinations(
    plan: DevicePlan, arena: Arena, tensors: Sequence[torch.Tensor], *, keep: bool = False
) -> list[torch.Tensor]:
    """The views of ``arena`` that ``plan`` fills; with ``keep`` (the staging cache's plan) built
    once per arena and kept by it.
    """
    views = arena.kept_views(plan) if keep else None
    if views is None:
        views = [_destination(arena, entry, tensors[entry.source]) for entry in plan.slots]
        if keep:
            arena.keep_views(plan, views)
    return views


def device_pairs(
    plan: DevicePlan,
    arena: Arena,
    tensors: Sequence[torch.Tensor],
    *,
    keep: bool = False,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(destination, source)`` for each entry of ``plan``."""
    if not plan.slots:
        return []
    views = destinations(plan, arena, tensors, keep=keep)
    pairs = []
    for entry, dst in zip(plan.slots, views, strict=True):
        src = tensors[entry.source]
        if not entry.whole:
            raw = torch.empty(0, dtype=torch.uint8, device=src.device)
            src = raw.set_(src.untyped_storage())
        pairs.append((dst, src))
    return pairs


CopyPair = tuple[torch.Tensor, torch.Tensor]  # (destination, source)

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}
_SIDE_LOCK = threading.Lock()


def _side_stream(device: int) -> torch.cuda.Stream:
    with _SIDE_LOCK:
        stream = _SIDE_STREAMS.get(device)
        if stream is None:
            stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
        return stream


def make_side_streams(devices: Sequence[int]) -> None:
    """Create the side streams of ``devices`` where the caller waits for them anyway.

    Pitfall: the first stream made on a device waits for all work queued there, so made by the
    staging thread it would wait for the training step. The warm-up and synchronizing saves make
    them, never an overlapped save.
    """
    for device in devices:
        _side_stream(device)


class DeviceOrder:
    """Made in the save call on the trainer's thread: an event on the current stream of every
    device in use, and the current device. :meth:`adopt` and :meth:`copy` run on the staging
    thread.
    """

    def __init__(self) -> None:
        self.device = torch.cuda.current_device()
        self._events: dict[int, torch.cuda.Event] = {}
        for device in cuda_devices_with_context():
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._events[device] = event

    def adopt(self) -> None:
        """Take the trainer's current device (per thread: pinning an arena here must not open a
        context on device 0).
        """
        torch.cuda.set_device(self.device)

    def copy(self, pairs: Sequence[CopyPair], non_blocking: bool) -> list[torch.cuda.Stream]:
        """Issue ``pairs`` after the recorded events; the side streams to synchronize (already
        waited for if issuing fails).
        """
        by_device: dict[int, list[CopyPair]] = {}
        for pair in pairs:
            by_device.setdefault(pair[1].get_device() if pair[1].is_cuda else -1, []).append(pair)
        streams: list[torch.cuda.Stream] = []
        try:
            for device, group in by_device.items():
                if device < 0:  # another device type: copied synchronously, in order
                    _issue(group, False, ())
                    continue
                stream = _side_stream(device)
                event = self._events.get(device)
                if event is None:  # not in use at the call: wait for its queued work
                    torch.cuda.synchronize(device)
                else:
                    stream.wait_event(event)
                streams.append(stream)
                with torch.cuda.stream(stream):
                    _issue(group, non_blocking, ())
        except BaseException:
            for stream in streams:
                stream.synchronize()
            raise
        return streams


def _issue(pairs: Sequence[CopyPair], non_blocking: bool, cuda: Sequence[int]) -> None:
    """``copy_`` each pair; on failure the devices ``cuda`` are synchronized first."""
    try:
        with torch.no_grad():
            for dst, src in pairs:
                dst.copy_(src, non_blocking=non_blocking)
    except BaseException:
        for device in cuda:
            torch.cuda.synchronize(device)
        raise


def _wait_streams(streams: Sequence[torch.cuda.Stream]) -> None:
    for stream in streams:
        stream.synchronize()


def _wait_devices(cuda: Sequence[int]) -> None:
    for device in cuda:
        torch.cuda.synchronize(device)
    make_side_streams(cuda)  # for overlapped saves, made while the devices are idle


def _nothing() -> None:
    return None


def start_copies(
    plan: DevicePlan,
    arena: Arena,
    tensors: Sequence[torch.Tensor],
    *,
    keep: bool = False,
    order: DeviceOrder | None = None,
) -> Callable[[], None]:
    """Issue ``plan``'s copies into ``arena``; return the wait that completes them (device-wide on
    the current streams, or, with ``order``, the side streams alone).

    A copy that fails to issue raises :class:`StagingError` once the copies issued before it
    completed: the caller then gives the arena back, and nothing may still write in it.
    """
    if not plan.slots:
        return _nothing
    pairs = device_pairs(plan, arena, tensors, keep=keep)
    try:
        if order is not None:
            return functools.partial(_wait_streams, order.copy(pairs, arena.pinned))
        _issue(pairs, arena.pinned, plan.cuda)
    except Exception as exc:
        raise StagingError(
            f"copying the snapshot's device tensors into shared memory failed: {exc!r}"
        ) from exc
    return functools.partial(_wait_devices, plan.cuda)
