"""Replicated async saves: exchange and writes in a trainer thread, not in the worker.

Replication is a collective on the clique's group, which exists only in the trainer (the
worker has no process group). Exchanging inside ``save()`` makes the trainer wait for the
network; handing the received replicas to the worker makes the queue stage them all.

Decision: with a gloo clique group, ``save(..., is_async=True)`` serializes this rank's shard
into one reused buffer (the snapshot: one copy, like the queue's staging of an unreplicated
save) and returns; a daemon thread per manager (so saves stay in order) exchanges the buffers
and writes every copy. That work is GIL-free (gloo waits, write syscalls, CRC), so it does
not slow the training loop. The returned :class:`~resilient_ckpt.async_ckpt.core.AsyncRequest`
still goes through the caller's queue: its ``async_fn`` (:func:`wait_for_status`) waits for
the thread's *status file* (``ok`` or the error, written atomically), so the queue reports
done or failed on every rank as for any request, and the finalize commits as usual.

Not with NCCL: two threads driving NCCL communicators can deadlock (the user's collectives
and ours may be ordered differently on different ranks), so there the exchange stays in
``save()``; ``CliqueReplicationStrategy.from_replication_params(..., backend="gloo")``
replicates through host memory in the background.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait

import torch

from .._logging import get_logger
from ..errors import CheckpointTimeoutError, StorageError
from ..storage.posix import PosixBackend
from .replication.strategies import (
    CliqueReplicationStrategy,
    LazyReplicationStrategyBuilder,
    ReplicationStrategy,
)

logger = get_logger(__name__)

OK = b"ok"


def clique_for_background(strategy: ReplicationStrategy | None) -> ReplicationStrategy | None:
    """The strategy to run in the thread, or None when the exchange must stay inline."""
    if isinstance(strategy, LazyReplicationStrategyBuilder):
        strategy = strategy.replication_strategy  # builds its groups here, in the trainer
    if not isinstance(strategy, CliqueReplicationStrategy):
        return None
    group = strategy.local_group
    if group.group is None or "gloo" not in group.backend:
        return None
    return strategy


def write_status(path: str, error: BaseException | None, sync: bool) -> None:
    body = OK if error is None else f"{type(error).__name__}: {error}".encode()
    with PosixBackend().open_write(path, sync=sync) as f:
        f.write(body)


def wait_for_status(path: str, timeout: float, poll_interval: float = 0.01) -> None:
    """``async_fn`` of a replicated async save: wait for the trainer thread's verdict."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(path, "rb") as f:
                body = f.read()
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise CheckpointTimeoutError(
                    f"replication of this local checkpoint did not finish within {timeout:.0f}s "
                    f"(no {os.path.basename(path)})"
                ) from None
            time.sleep(poll_interval)
            continue
        if body == OK:
            return
        raise StorageError(f"replicated local checkpoint save failed: {body.decode()}")


class BackgroundSaves:
    """One daemon thread running replicated saves in order, for one manager.

    A daemon thread (not a ``ThreadPoolExecutor``, whose threads are joined at interpreter
    exit): a save stuck in a collective with a dead peer must not keep the process alive.
    """

    def __init__(self, max_buffers: int = 2) -> None:
        self._jobs: queue.Queue[tuple[Callable[[], None], Future[None]]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._pending: list[Future[None]] = []
        self._max_buffers = max_buffers
        self._free: list[torch.Tensor] = []
        self._buffers = 0
        self._lock = threading.Lock()

    def acquire(self, nbytes: int, timeout: float) -> torch.Tensor:
        """A serialization buffer of ``nbytes``: a view of a reused, already touched one, so
        the snapshot does not page-fault fresh memory. At most ``max_buffers`` exist; when all
        are in use, wait for the running saves."""
        while True:
            with self._lock:
                fitting = [b for b in self._free if b.numel() >= nbytes]
                if fitting:
                    base = min(fitting, key=lambda b: b.numel())
                    # By identity: list.remove compares tensors with ==, elementwise.
                    self._free = [b for b in self._free if b is not base]
                    return base[:nbytes]
                if self._buffers >= self._max_buffers and self._free:
                    self._free.sort(key=lambda b: b.numel())
                    self._free.pop(0)  # too small for this state: replace it
                    self._buffers -= 1
                if self._buffers < self._max_buffers:
                    self._buffers += 1
                    return torch.empty(nbytes, dtype=torch.uint8)
            self.drain(timeout)

    def release(self, buffer: torch.Tensor) -> None:
        base = buffer if buffer._base is None else buffer._base
        with self._lock:
            self._free.append(base)

    def _run(self) -> None:
        while True:
            job, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                job()
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(None)

    def submit(self, job: Callable[[], None]) -> Future[None]:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="resilient_ckpt-replication", daemon=True
            )
            self._thread.start()
        device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

        def _job() -> None:
            if device is not None:
                torch.cuda.set_device(device)  # the current device is per thread
            job()

        future: Future[None] = Future()
        self._pending = [f for f in self._pending if not f.done()] + [future]
        self._jobs.put((_job, future))
        return future

    def drain(self, timeout: float) -> None:
        """Wait for every submitted save (their errors reach the user through the queue)."""
        pending = [f for f in self._pending if not f.done()]
        if not pending:
            return
        _, not_done = wait(pending, timeout)
        if not_done:
            raise CheckpointTimeoutError(
                f"{len(not_done)} replicated local checkpoint save(s) still running after "
                f"{timeout:.0f}s; the clique group cannot be used until they end"
            )
        self._pending = []
