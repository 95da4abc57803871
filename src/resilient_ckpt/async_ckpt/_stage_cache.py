"""The steady-state fast path of staging: reuse the previous save's descriptors and copy plan.

Decision: a training job saves the same structure again and again: the same containers and
keys, tensors with the same shapes, dtypes and strides, mostly in the very same memory. Then
everything staging derives from the tensors' *layout* is the same as at the previous save:
each tensor's descriptor (slot, dtype, size, stride, offset), which storages share a slot,
the slots' places in the arena, and the coalesced copy ranges split over the copy threads.
Only the bytes differ. So a save first pickles the request *optimistically*, with a reducer
that answers its i-th call with the previous save's i-th result (one list append, no
per-tensor queries; a call is one tensor, or a whole ``TensorBatch`` of the staging layer,
whose descriptors travel as one blob pickled at the full staging), then checks the guess:
every tensor met, in order, must have the previous save's *layout* (:func:`layouts`)::

    (type, device, layout, dtype, shape, stride, requires_grad, conjugate and negative
     bits, storage offset, storage address, storage bytes)

Equal layouts, position by position, mean equal descriptors and equal slot grouping (both are
functions of the layouts alone), and equal source addresses and lengths, so the cached copy
plan copies exactly the bytes the full path would. The non-tensor part of the request
(paths, step counters, the write items) is pickled afresh every save, so its new values are
always in the payload. A ``SourcedBatch`` (the async DCP writer's bucket) gives this pickle
its tensors by a quick lookup without its checks: equal layouts to a full staging, which ran
them, imply they pass. Any difference (a tensor added, removed, reshaped, re-typed, replaced
by one in other memory, or a different count of reducer calls or of tensors per call)
falls back to the full path, which rebuilds the cache. Identity is deliberately not part of
the layout: a tensor replaced by a new object over the *same* memory and layout is staged
identically, and the same object whose storage was swapped (``.data =``, ``set_``) has a
new address or layout and misses. (Where identity decides what is written, a tensor of a
``torch.save`` state's batched dict met again elsewhere, the optimistic pickle checks it as
the full one does: see ``_Guess``.)

Only requests whose tensors are all strided are cached (by-value tensors would repeat stale
values). Device tensors are: their copies are planned from the layouts too
(:mod:`._copy`), which tensor fills which slot, and the slots' typed views are kept
by each arena. The cache holds no reference to any tensor: only the layouts (plain values)
and the plans.

The layouts are read through public tensor methods, each field one C-level ``map`` over the
tensors. (An earlier version compared the first fields with ``torch.compile``'s private C++
tensor guard; at a realistic shape, a gigabyte per rank, the difference is lost in the copy,
so the public reading is the only one.)
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .._logging import get_logger
from ._arena import Arena, ArenaPool
from ._copy import (
    NO_DEVICE,
    DeviceOrder,
    DevicePlan,
    Segment,
    copy_all,
    destinations,
    plan_shares,
    start_copies,
)
from ._worker import Slot

if TYPE_CHECKING:  # _staging imports this module
    from ._staging import BatchedWhenPickled, SourcedBatch

logger = get_logger(__name__)


# One C-level call per tensor for the fields that are plain attributes.
_ATTRIBUTES = operator.attrgetter("device", "layout", "dtype", "shape", "requires_grad")


def tensor_meta(tensors: Sequence[torch.Tensor]) -> tuple[list, ...]:
    """Type, device, layout, dtype, shape, ``requires_grad``, stride and the conjugate and
    negative bits of every tensor, as columns (one list per field). Raises for a tensor
    without strides."""
    return (
        list(map(type, tensors)),
        list(map(_ATTRIBUTES, tensors)),
        list(map(torch.Tensor.stride, tensors)),
        list(map(torch.Tensor.is_conj, tensors)),
        list(map(torch.Tensor.is_neg, tensors)),
    )


def layouts(tensors: Sequence[torch.Tensor]) -> tuple[list, ...]:
    """The whole layout of every tensor: :func:`tensor_meta` and where its bytes lie.
    Two requests whose layouts are equal stage to the same descriptors, slots and copy
    ranges. Raises for a tensor without strides or without a strided storage."""
    storages = list(map(torch.Tensor.untyped_storage, tensors))
    return (
        *tensor_meta(tensors),
        list(map(torch.Tensor.storage_offset, tensors)),
        list(map(torch.UntypedStorage.data_ptr, storages)),
        list(map(torch.UntypedStorage.nbytes, storages)),
    )


def unchanged(
    read: Callable[[Sequence[torch.Tensor]], tuple[list, ...]],
    expected: tuple[list, ...],
    tensors: Sequence[torch.Tensor],
) -> bool:
    """Whether ``read(tensors)`` (:func:`layouts` or :func:`tensor_meta`) equals
    ``expected``; False for tensors it cannot read (e.g. sparse: no strides)."""
    try:
        return read(tensors) == expected
    except Exception:
        return False


class _Miss(Exception):
    """The optimistic pickle met more tensors than the cached request had."""


class _Guess:
    """Reducer of the optimistic pickle: the i-th reducer call gets the cached i-th result,
    if it describes as many tensors as the cached call did.

    A ``BatchedWhenPickled`` state is batched as at the full staging (``batch_dicts``), and
    a single tensor that is also in a batch misses, as the full staging would stage the state
    again unbatched (see ``_staging.TensorDict``); equal layouts cannot tell that apart."""

    __slots__ = ("batch_dicts", "batched", "calls", "counts", "reduced", "tensors")

    def __init__(self, reduced: list[Any], counts: list[int], batch_dicts: bool) -> None:
        self.reduced = reduced
        self.counts = counts
        self.batch_dicts = batch_dicts
        self.batched: set[int] = set()
        self.calls = 0
        self.tensors: list[torch.Tensor] = []

    def _next(self, count: int) -> Any:
        index = self.calls
        self.calls = index + 1
        if index >= len(self.reduced) or self.counts[index] != count:
            raise _Miss
        return self.reduced[index]

    def reduce_state(self, state: BatchedWhenPickled) -> tuple:
        return state.reduce(self.batched if self.batch_dicts else None)

    def reduce_tensor(self, obj: torch.Tensor) -> Any:
        if id(obj) in self.batched:
            raise _Miss
        self.tensors.append(obj)
        return self._next(1)

    def reduce_batch(self, batch: list[torch.Tensor]) -> Any:
        self.tensors.extend(batch)
        return self._next(len(batch))

    def reduce_sourced(self, batch: SourcedBatch) -> Any:
        # The quick lookup is safe here: this pickle is used only if the layouts match
        # a full staging's, which ran the batch's checks (see SourcedBatch).
        tensors = batch.quick()
        return self.reduce_batch(batch.checked() if tensors is None else tensors)


class StageCache:
    """One queue's memory of its previous staged request (see the module docstring).

    ``hits`` and ``misses`` count the saves that did and did not reuse it.
    """

    def __init__(self) -> None:
        self._reduced: list[Any] | None = None
        self._counts: list[int] = []
        self._batch_dicts = True
        self._layout: tuple[list, ...] | None = None
        self._slots: tuple[Slot, ...] = ()
        self._total = 0
        self._threads = 0
        self._shares: list[list[Segment]] = []
        self._device = NO_DEVICE
        self.hits = 0
        self.misses = 0

    def clear(self) -> None:
        self._reduced = None
        self._counts = []
        self._layout = None
        self._shares = []
        self._device = NO_DEVICE

    def remember(
        self,
        tensors: list[torch.Tensor],
        reduced: list[Any],
        counts: list[int],
        reusable: bool,
        batch_dicts: bool,
        slots: tuple[Slot, ...],
        host: list[Segment],
        device: DevicePlan,
        total: int,
        threads: int,
        *,
        counted: bool = True,
    ) -> None:
        """After a full staging: keep what the next save of this layout can reuse.

        ``reduced``/``counts``: each reducer call's result and how many of ``tensors`` it
        described. ``batch_dicts``: whether that staging batched a ``BatchedWhenPickled``
        state's dicts (False after it met a batched tensor twice; the next full staging tries
        again). ``host``: the copy ranges with destinations relative to the arena's start.
        ``counted``: a save missed the cache (False for a warm-up, which saves nothing).
        """
        self.misses += int(counted)
        if not reusable or len(reduced) != len(counts) or sum(counts) != len(tensors):
            self.clear()
            return
        try:
            layout = layouts(tensors)
        except Exception as exc:  # an exotic tensor: never reuse, stage fully
            logger.debug("staging cache disabled for this request: %r", exc)
            self.clear()
            return
        self._reduced = list(reduced)
        self._counts = list(counts)
        self._batch_dicts = batch_dicts
        self._layout = layout
        self._slots = slots
        self._total = total
        self._threads = threads
        self._shares = plan_shares(host, threads)
        self._device = device

    def try_pickle(
        self, obj: Any, dump: Callable[[Any, Any], bytes], threads: int
    ) -> tuple[bytes, list[torch.Tensor]] | None:
        """The payload of ``obj`` if its tensors are laid out as at the previous save, with
        the tensors met (to keep alive while copying); None on any difference."""
        layout = self._layout
        if self._reduced is None or layout is None or threads != self._threads:
            return None
        guess = _Guess(self._reduced, self._counts, self._batch_dicts)
        try:
            payload = dump(obj, guess)
            if guess.calls != len(self._reduced) or not unchanged(layouts, layout, guess.tensors):
                return None
        except Exception:  # _Miss, or anything the full path will report properly
            return None
        self.hits += 1
        return payload, guess.tensors

    def planned_for(self, slots: tuple[Slot, ...]) -> bool:
        """Whether the cache holds the copy plan of the staging that laid out ``slots``
        (just remembered)."""
        return self._reduced is not None and self._slots is slots

    @property
    def slots(self) -> tuple[Slot, ...]:
        return self._slots

    @property
    def total(self) -> int:
        return self._total

    def prepare(self, arena: Arena, tensors: list[torch.Tensor]) -> None:
        """Build in ``arena`` now what a save with the cached plan would build on first use
        of it (the device copies' typed views): the warm-up's part of the first save.
        ``tensors``: those the cache was filled from, in its order."""
        if (
            tensors
            and self._reduced is not None
            and self._device.slots
            and arena.nbytes >= self._total
        ):
            destinations(self._device, arena, tensors, keep=True)

    def copy(
        self,
        pool: ArenaPool,
        wait_for_release: Callable[[], bool],
        tensors: list[torch.Tensor],
        *,
        order: DeviceOrder | None = None,
    ) -> Arena:
        """Acquire an arena and copy into it with the cached plan (see ``copy_all``);
        ``tensors``: the request's, in the order the plan indexes them."""
        arena = pool.acquire(self._total, wait_for_release)
        try:
            # The device copies are issued first, to run while the host ranges are copied.
            device_wait = start_copies(self._device, arena, tensors, keep=True, order=order)
            copy_all(
                (),
                threads=self._threads,
                device_wait=device_wait,
                shares=self._shares,
                base=arena.address,
            )
        except BaseException:
            pool.release(arena.arena_id)
            raise
        return arena
