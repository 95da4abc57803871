"""Shared-memory arenas (one ``memfd`` each) and the bounded pool that reuses them.

A ``memfd`` has no name and disappears when the last process holding it exits, so a SIGKILL
leaves nothing behind (unlike ``multiprocessing.shared_memory`` files in ``/dev/shm``).
Arenas are created pre-faulted (``MAP_POPULATE``): the first copy into one runs at memory
speed. The pool keeps at most ``max_arenas``; an arena too small for the state is closed
when a larger one replaces it, so memory follows the state instead of accumulating.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
from collections.abc import Callable

import torch

from .._logging import get_logger
from ..errors import CheckpointTimeoutError, InvalidRequestError, StagingError

logger = get_logger(__name__)

_MIN_BYTES = 64
_arena_ids = itertools.count(1)


ARENA_NAME = "resilient_ckpt_arena"  # memfd name prefix: how tools find the arenas


def open_arena_fds() -> int:
    """Distinct staging-arena memfds this process holds open (a mapping keeps a dup)."""
    names = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if ARENA_NAME in target:
            names.add(target)
    return len(names)


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
        self.nbytes = max(int(nbytes), _MIN_BYTES)
        owns_fd = fd is None
        if fd is None:
            fd = os.memfd_create(f"{ARENA_NAME}_{self.arena_id}", os.MFD_CLOEXEC)
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
        self._kept: tuple[object, list[torch.Tensor]] | None = None
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

    def kept_views(self, key: object) -> list[torch.Tensor] | None:
        """The views kept for ``key`` (compared by identity) by :meth:`keep_views`, if any."""
        kept = self._kept
        return kept[1] if kept is not None and kept[0] is key else None

    def keep_views(self, key: object, views: list[torch.Tensor]) -> None:
        """Keep ``views`` of this arena for reuse under ``key`` (one set: the latest), until
        the arena closes."""
        self._kept = (key, views)

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
        self._kept = None
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

    def has_room(self) -> bool:
        """Whether :meth:`acquire` can return without waiting for a release."""
        with self._lock:
            return bool(self.free) or len(self.busy) < self.max_arenas

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
