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

Decision, for overlapped staging (the whole staging on a background thread): the save call
records an event on the current stream of each CUDA device in use (:class:`DeviceOrder`);
the staging thread issues the copies on a side stream per device that first waits for that
event, and then waits for the side streams alone. The copies so read the values the call
saw (kernels queued before it included), the trainer's stream never waits for them, and the
snapshot never waits for the training step queued meanwhile (a device-wide synchronize
would).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch

from .._torch_compat import cuda_devices_with_context
from ..errors import StagingError
from ._arena import Arena
from ._worker import Slot

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


def destinations(
    plan: DevicePlan, arena: Arena, tensors: Sequence[torch.Tensor], *, keep: bool = False
) -> list[torch.Tensor]:
    """The views of ``arena`` that ``plan``'s entries fill. ``keep``: the plan is the
    staging cache's, reused save after save: they are built once per arena and kept by it
    (about 4 us a tensor to build: 8 ms for 2000, so the warm-up builds them)."""
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
    """``(destination, source)`` for each entry of ``plan``, into ``arena`` (``keep``: see
    :func:`destinations`)."""
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
    """Create the side streams of ``devices`` now, where the caller waits for them anyway.

    The first stream made on a device waits for all the work queued there (measured on an
    H200: a staging thread making it waited for the training step queued after the call,
    560 ms, where steady overlapped saves waited 51 ms). So they are made by the warm-up and
    by every save that synchronizes the devices it read, not by an overlapped save.
    """
    for device in devices:
        _side_stream(device)


class DeviceOrder:
    """Made in the save call, on the trainer's thread (CUDA initialised): an event on the
    current stream of every device in use, and the current device. :meth:`adopt` and
    :meth:`copy` run on the staging thread."""

    def __init__(self) -> None:
        self.device = torch.cuda.current_device()
        self._events: dict[int, torch.cuda.Event] = {}
        for device in cuda_devices_with_context():
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._events[device] = event

    def adopt(self) -> None:
        """Make the trainer's current device this thread's (the current device is per
        thread: pinning an arena here must not open a context on device 0)."""
        torch.cuda.set_device(self.device)

    def copy(self, pairs: Sequence[CopyPair], non_blocking: bool) -> list[torch.cuda.Stream]:
        """Issue ``pairs`` after the recorded events; the side streams to synchronize
        (waited for already if issuing fails, see :func:`start_copies`)."""
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
    """``copy_`` each pair on the current streams (the devices ``cuda`` synchronized
    already if one fails, see :func:`start_copies`)."""
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
    """Issue ``plan``'s copies into ``arena`` and return the wait that completes them:
    on the calling thread's current streams (the wait synchronizes each device read), or,
    with ``order`` (a background staging), on side streams after the save call's events
    (the wait synchronizes those streams alone). ``keep``: see :func:`destinations`.

    A copy that fails to issue raises :class:`StagingError` once what was issued before it
    has completed: the caller then gives the arena back, and nothing may still write in it.
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
