"""The trainer-side data copy of a snapshot: host storages into an arena, several threads.

Decisions:

* **memmove, not ``copy_``.** Every staged CPU storage is one contiguous byte range, so the
  copy is a ``memmove`` into its slot. ``ctypes.memmove`` costs about a microsecond per
  call (``Tensor.copy_`` several), and, being a foreign call, releases the GIL: copy threads
  run truly in parallel, and in overlapped staging in parallel with the training step.
* **Neighbours copied as one range.** The arena mirrors host storages that lie close in
  memory (:mod:`._placement`), so a run of consecutive allocations is one ``memmove``, the
  allocator's headers between them included; ranges still back to back both in memory and
  in the arena are merged here.
* **Large states split over threads.** Above ``PARALLEL_MIN_BYTES`` the byte ranges are cut
  into ``threads`` shares of equal bytes (a large storage is split inside), one per thread of
  a persistent pool; the calling thread copies one share itself.
  A single thread rarely saturates memory bandwidth; several do. The default thread count is
  ``min(4, cores of this process / local ranks)`` (``RESILIENT_CKPT_COPY_THREADS``
  overrides it), so ranks sharing a node do not oversubscribe it.
* **Device storages** (CUDA) keep ``Tensor.copy_`` into the pinned arena (what fills which
  slot, and on which stream: :mod:`._device_copy`), waited for before the snapshot counts
  as taken.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from .._logging import get_logger
from ..errors import ConfigurationError, StagingError

logger = get_logger(__name__)

PARALLEL_MIN_BYTES = 8 << 20
COPY_THREADS_ENV = "RESILIENT_CKPT_COPY_THREADS"

# (destination address, source address, bytes)
Segment = tuple[int, int, int]


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
    """Cut ``segments`` into at most ``shares`` lists of (nearly) equal bytes, in order;
    one list if they total less than ``min_bytes`` (default ``PARALLEL_MIN_BYTES``)."""
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
    """Copy ``host`` ranges, then complete the device copies already issued
    (``device_wait``, from :func:`._device_copy.start_copies`, so they ran meanwhile);
    every byte is in the arena when this returns, or when it raises.

    The calling thread takes one share of the host ranges, the pool the others. ``shares``
    (from :func:`plan_shares`, destinations relative to ``base``) replaces ``host`` when the
    plan is already known.
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
