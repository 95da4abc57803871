"""``Stager``: torch's ``AsyncStager`` protocol, staging into reused shared-memory arenas.

What it decides:

* **Where the snapshot goes.** Every tensor of the state is copied into one arena per
  snapshot: shared-memory storages (``UntypedStorage.share_memory_()``, torch's own sharing
  allocator), the plain tensors as views of one storage at 64-byte aligned offsets, each
  DTensor shard in a storage of its own (torch crashes pickling a DTensor whose shard starts
  at an offset inside its storage). DTensors
  are staged as their local shard and rebuilt around it with the same mesh and placements
  (the shard stays in host memory, also for a CUDA mesh);
  other values are deep-copied, as torch's ``DefaultStager`` does.
* **Crossing torch's process executor without a copy.** That executor pickles the staged
  dict over a pipe to its daemon with torch's multiprocessing reducers. A tensor whose
  storage is already shared is sent as a handle to that storage (a file descriptor, or a
  shared-memory name under the ``file_system`` strategy); the daemon maps it, and tensors
  of one storage map it once. A private CPU tensor would be moved into new shared memory
  first, a full copy per save: that is what an arena already in shared memory avoids.
  Alternatives: a memfd of our own with a custom reducer registered in
  ``ForkingPickler`` (process-wide, changes how every tensor of the program pickles), or a
  tensor subclass with its own reducer (its class would then be pickled into the data files
  by ``torch.save``).
* **When an arena may be reused.** An arena is in use while any tensor staged into it is
  alive: the executor holds the staged dict until its save returned (the process executor
  until its daemon answered). The stager keeps weak references to what it handed out and
  reuses an arena once they are all gone, so a structure saved again and again stays in
  the same memory. At most ``max_arenas`` exist; a stage that finds all of them in use waits
  for one (bounded by the finalize deadline, then a ``StagingError`` naming
  ``max_arenas``). A larger state replaces a free arena by a larger one.
* **Synchronous or background staging.** ``Stager()`` stages in the call and ``stage``
  returns the staged dict (torchtitan's ``async`` mode; torch's ``dcp.async_save`` then
  returns a ``Future``). ``Stager(async_staging=True)`` copies on a background thread and
  ``stage`` returns a ``Future`` of the dict (torchtitan's pinned mode; ``dcp.async_save``
  then returns an ``AsyncSaveResponse`` whose ``staging_completion`` says when the state
  may change again).
"""

from __future__ import annotations

import copy
import gc
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE
from torch.distributed.checkpoint.staging import AsyncStager

from .._logging import get_logger
from .._torch_compat import dtensor_around, loaded_dtensor
from ..config import default_timeouts
from ..errors import ConfigurationError, StagingError

logger = get_logger(__name__)

__all__ = ["Stager"]

_ALIGN = 64


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class _Arena:
    """Shared-memory storages for one snapshot, and weak references to the tensors staged
    into them. ``sizes[0]`` bytes hold the plain tensors, one after the other; each DTensor
    shard has a storage of its own (``sizes[1:]``, in walk order): torch 2.13 crashes
    pickling a DTensor whose shard starts inside a storage (a nonzero storage offset)."""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.sizes = sizes
        self.nbytes = sum(sizes)
        self.storages = [torch.UntypedStorage(max(n, _ALIGN)).share_memory_() for n in sizes]
        self._handed_out: list[weakref.ref] = []

    def fits(self, sizes: tuple[int, ...]) -> bool:
        return len(sizes) == len(self.sizes) and all(
            need <= have for need, have in zip(sizes, self.sizes, strict=True)
        )

    def in_use(self) -> bool:
        self._handed_out = [ref for ref in self._handed_out if ref() is not None]
        return bool(self._handed_out)

    def hand_out(self, objects: list[Any]) -> None:
        self._handed_out = [weakref.ref(obj) for obj in objects]

    def view(self, storage: int, offset: int, like: torch.Tensor) -> torch.Tensor:
        out = torch.empty((0,), dtype=like.dtype)
        shape = list(like.shape)
        strides = _contiguous(shape)
        return out.set_(self.storages[storage], offset // like.element_size(), shape, strides)


def _contiguous(shape: list[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return strides[::-1]


def _sources(obj: Any, dtensor: Any, found: list[tuple[torch.Tensor, bool]]) -> None:
    """Every tensor to stage in ``obj``, in walk order, and whether it is a DTensor's shard."""
    if dtensor is not None and isinstance(obj, dtensor):
        found.append((obj.to_local(), True))
    elif isinstance(obj, torch.Tensor):
        found.append((obj, False))
    elif isinstance(obj, dict):
        for value in obj.values():
            _sources(value, dtensor, found)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _sources(value, dtensor, found)


def _rebuild(obj: Any, dtensor: Any, staged: Any, kept: list[Any]) -> Any:
    """``obj`` with every tensor replaced by the next of ``staged`` (the same walk as
    :func:`_sources`); what is put into the result is appended to ``kept``."""
    if dtensor is not None and isinstance(obj, dtensor):
        out = dtensor_around(obj, next(staged))
        kept.append(out)
        return out
    if isinstance(obj, torch.Tensor):
        out = next(staged)
        kept.append(out)
        return out
    if isinstance(obj, dict):
        rebuilt = copy.copy(obj)  # the same mapping type, then every value staged
        for key, value in obj.items():
            rebuilt[key] = _rebuild(value, dtensor, staged, kept)
        return rebuilt
    if isinstance(obj, (list, tuple)):
        items = [_rebuild(value, dtensor, staged, kept) for value in obj]
        if isinstance(obj, list):
            return type(obj)(items) if type(obj) is not list else items
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return copy.deepcopy(obj)


class Stager(AsyncStager):
    """torch's ``AsyncStager`` staging into reused shared memory (see the module note).

    Call protocol (the trainer, one thread): ``stage(state_dict)`` for every save, by torch's
    ``dcp.async_save(async_stager=stager)`` or directly; with ``async_staging=True`` the
    staged dict comes from the returned ``Future`` (``synchronize_staging()`` waits for the
    last one); ``close()`` after the last save (twice is harmless). The stager is owned by
    the caller and used by one thread at a time, as torch's ``DefaultStager``.

    Args:
        async_staging: copy on a background thread; ``stage`` returns a ``Future``.
        max_arenas: how many snapshots may be alive at once (bounds host memory to that many
            copies of the state).
    """

    def __init__(self, *, async_staging: bool = False, max_arenas: int = 2) -> None:
        if not isinstance(async_staging, bool):
            raise ConfigurationError(
                f"Stager(async_staging=...) must be a bool, got {async_staging!r}"
            )
        if not isinstance(max_arenas, int) or isinstance(max_arenas, bool) or max_arenas < 1:
            raise ConfigurationError(
                f"Stager(max_arenas=...) must be an int >= 1, got {max_arenas!r}"
            )
        self.async_staging = async_staging
        self.max_arenas = max_arenas
        self._synchronize_after_execute = async_staging
        self._arenas: list[_Arena] = []
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._last: Future[STATE_DICT_TYPE] | None = None
        self._closed = False
        self._wait_s = default_timeouts().finalize

    @property
    def arena_count(self) -> int:
        """How many arenas (shared-memory snapshots) exist now."""
        return len(self._arenas)

    def stage(self, state_dict: STATE_DICT_TYPE) -> STATE_DICT_TYPE | Future[STATE_DICT_TYPE]:
        """A snapshot of ``state_dict`` in shared memory: the dict (or, with
        ``async_staging``, a ``Future`` of it)."""
        if self._closed:
            raise StagingError("Stager.stage after close(): create a new Stager")
        if not self.async_staging:
            return self._stage(state_dict)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="resilient_ckpt_stager")
        self._last = self._executor.submit(self._stage, state_dict)
        return self._last

    def synchronize_staging(self) -> None:
        """Wait for the last background staging (a no-op for synchronous staging)."""
        if self._last is not None:
            self._last.result()

    def close(self) -> None:
        """Wait for a background staging, then drop the arenas (their memory is freed once
        the last staged tensor is gone). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        with self._lock:
            self._arenas.clear()

    def _stage(self, state_dict: STATE_DICT_TYPE) -> STATE_DICT_TYPE:
        dtensor = loaded_dtensor()
        sources: list[tuple[torch.Tensor, bool]] = []
        _sources(state_dict, dtensor, sources)
        places, plain, shards = [], 0, []
        for tensor, is_shard in sources:
            nbytes = _align(tensor.numel() * tensor.element_size())
            if is_shard:
                shards.append(nbytes)
                places.append((len(shards), 0))
            else:
                places.append((0, plain))
                plain += nbytes
        arena = self._acquire((plain, *shards))
        views = []
        for (tensor, _), (storage, offset) in zip(sources, places, strict=True):
            view = arena.view(storage, offset, tensor)
            view.copy_(tensor.detach())
            views.append(view)
        kept: list[Any] = []
        staged = _rebuild(state_dict, dtensor, iter(views), kept)
        arena.hand_out(kept)
        return staged  # type: ignore[no-any-return]

    def _acquire(self, sizes: tuple[int, ...]) -> _Arena:
        """A free arena that fits ``sizes`` (waiting for one while ``max_arenas`` are in use,
        up to the deadline)."""
        deadline = time.monotonic() + self._wait_s
        collected = False
        while True:
            with self._lock:
                free = [a for a in self._arenas if not a.in_use()]
                fitting = [a for a in free if a.fits(sizes)]
                if fitting:
                    return min(fitting, key=lambda a: a.nbytes)
                if free or len(self._arenas) < self.max_arenas:
                    if free:  # too small: replaced, so memory follows the state
                        self._arenas.remove(max(free, key=lambda a: a.nbytes))
                    arena = _Arena(sizes)
                    self._arenas.append(arena)
                    logger.debug(
                        "staging arena of %d bytes (%d alive)", arena.nbytes, len(self._arenas)
                    )
                    return arena
            if not collected:  # a staged dict kept only by a reference cycle
                gc.collect()
                collected = True
                continue
            if time.monotonic() >= deadline:
                raise StagingError(
                    f"Stager: all {self.max_arenas} staging arenas (max_arenas) still hold "
                    f"snapshots after {self._wait_s:.0f}s: wait for the earlier saves before "
                    "staging another, or raise max_arenas"
                )
            time.sleep(0.005)
