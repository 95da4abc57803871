"""Injecting faults into storage and background calls, in the process that does the I/O.

Three layers, each built on the one before:

* :class:`FaultyBackend` wraps any :class:`~resilient_ckpt.storage.StorageBackend` (POSIX,
  object store, or one written later) and fires storage-phase faults inside its operations;
  a write fault hits the byte stream itself, so a failure can leave a partly written
  temporary file exactly as a real one would, and the backend's own clean-up runs.
* :func:`inject` installs such a wrapper for every backend the library asks for in this
  process (through :func:`resilient_ckpt.storage.set_backend_wrapper`), for one ``with``
  block. :class:`FaultyCall` does the same around one background call *in the process that
  runs it* (the persistent worker, a forked child, or the trainer for synchronous saves),
  and adds the call phases (before, at a random time during, after).
* Drop-in classes for tests: :class:`FaultyWriter` (an async DCP writer) and
  :class:`FaultyLocalCheckpointManager`, plus :func:`faulty_request` for any
  :class:`~resilient_ckpt.async_ckpt.core.AsyncRequest`.

Why not a subclass per backend: wrapping composes with every backend, including the ones
other people add, and keeps test code out of the backends.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, BinaryIO

from ...async_ckpt.core import AsyncRequest
from ...async_ckpt.filesystem_async import FileSystemWriterAsync
from ...local.ckpt_managers.local_manager import LocalCheckpointManager
from ...storage import Listing, StorageBackend, set_backend_wrapper
from ._plan import Action, Fault, Injector, Phase, act, as_faults, current_rank, delay_within


class _FaultyStream:
    """A write stream that fires ``WRITE`` faults at their byte offsets."""

    def __init__(self, raw: Any, injector: Injector, path: str) -> None:
        self._raw = raw
        self._injector = injector
        self._path = path
        self._pending = sorted(
            injector.candidates(Phase.WRITE, path), key=lambda item: item[1].after_bytes
        )
        self._offset = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if not view.contiguous:
            view = memoryview(view.tobytes())
        view = view.cast("B")
        total = view.nbytes
        end = self._offset + total
        while self._pending and self._pending[0][1].after_bytes < end:
            index, fault = self._pending.pop(0)
            if fault.after_bytes < self._offset or not self._injector.claim(index):
                continue
            cut = fault.after_bytes - self._offset
            if fault.action == Action.CORRUPT:
                changed = bytearray(view)
                changed[cut] ^= 0xFF
                view = memoryview(bytes(changed))
                continue
            self._raw.write(view[:cut])
            self._offset += cut
            view = view[cut:]
            self._raw.flush()
            where = f"write of {self._path} at byte {fault.after_bytes}"
            act(fault, where, self._injector.rank, self._injector.trainer)
        self._raw.write(view)
        self._offset = end
        return total

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class FaultyBackend(StorageBackend):
    """``inner`` with the storage-phase faults of ``injector`` (see :class:`Phase`)."""

    def __init__(self, inner: StorageBackend, injector: Injector) -> None:
        self.inner = inner
        self.injector = injector
        self.scheme = inner.scheme

    def makedirs(self, path: str) -> None:
        self.injector.fire(Phase.MAKEDIRS, path)
        self.inner.makedirs(path)

    @contextmanager
    def open_write(self, path: str, *, sync: bool = True) -> Iterator[BinaryIO]:
        self.injector.fire(Phase.OPEN_WRITE, path)
        with self.inner.open_write(path, sync=sync) as raw:
            yield _FaultyStream(raw, self.injector, path)  # type: ignore[misc]
            self.injector.fire(Phase.BEFORE_COMMIT, path)

    def open_read(self, path: str) -> AbstractContextManager[BinaryIO]:
        self.injector.fire(Phase.OPEN_READ, path)
        return self.inner.open_read(path)

    def scan(self, path: str) -> Listing:
        return self.inner.scan(path)

    def list(self, path: str) -> list[str]:
        return self.inner.list(path)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def is_dir(self, path: str) -> bool:
        return self.inner.is_dir(path)

    def size(self, path: str) -> int:
        return self.inner.size(path)

    def delete(self, path: str, *, recursive: bool = False, sync: bool = False) -> None:
        self.injector.fire(Phase.DELETE, path)
        self.inner.delete(path, recursive=recursive, sync=sync)

    def join(self, *parts: str) -> str:
        return self.inner.join(*parts)


@contextmanager
def installed(injector: Injector) -> Iterator[Injector]:
    """Route this process's backends through ``injector`` for the ``with`` block."""
    previous = set_backend_wrapper(None)

    def wrap(backend: StorageBackend, path: str) -> StorageBackend:
        inner = previous(backend, path) if previous is not None else backend
        return FaultyBackend(inner, injector)

    set_backend_wrapper(wrap)
    try:
        yield injector
    finally:
        set_backend_wrapper(previous)


def inject(
    faults: Fault | Sequence[Fault], rank: int | None = None
) -> AbstractContextManager[Injector]:
    """``with inject(faults):`` every storage operation of the library in this process (on
    rank ``rank``, default: this process's) is subject to ``faults``."""
    return installed(Injector(as_faults(faults), rank))


class FaultyCall:
    """``fn`` run under ``faults`` (storage and call phases) in whichever process calls it.

    Picklable when ``fn`` is, so it can be a request's ``async_fn``: the faults then fire in
    the background worker. The rank, and the trainer ``Action.KILL_PARENT`` may kill, are
    fixed when the call is made (in the trainer).
    """

    def __init__(
        self, fn: Callable[..., Any], faults: Fault | Sequence[Fault], rank: int | None = None
    ) -> None:
        self.fn = fn
        self.faults = as_faults(faults)
        self.rank = current_rank() if rank is None else rank
        self.trainer = os.getpid()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        injector = Injector(self.faults, self.rank, self.trainer)
        with installed(injector):
            injector.fire(Phase.BEFORE_CALL)
            cancel = threading.Event()
            timers = [
                _start_during(injector, index, fault, cancel)
                for index, fault in injector.candidates(Phase.DURING_CALL)
            ]
            try:
                result = self.fn(*args, **kwargs)
            except BaseException:
                cancel.set()  # the call is over: a later kill would hit the next one
                raise
            for timer in timers:  # a kill "during" the call happens before it returns
                timer.join()
            injector.fire(Phase.AFTER_CALL)
        return result

    def __repr__(self) -> str:
        return f"FaultyCall({self.fn!r}, {list(self.faults)!r}, rank={self.rank})"


def _start_during(
    injector: Injector, index: int, fault: Fault, cancel: threading.Event
) -> threading.Thread:
    def fire_later() -> None:
        if not cancel.wait(delay_within(fault)) and injector.claim(index):
            act(fault, "a random point of the call", injector.rank, injector.trainer)

    thread = threading.Thread(target=fire_later, name="resilient_ckpt-fault", daemon=True)
    thread.start()
    return thread


def faulty_request(
    request: AsyncRequest, faults: Fault | Sequence[Fault], rank: int | None = None
) -> AsyncRequest:
    """``request`` whose background call runs under ``faults`` (a no-op request is kept)."""
    if request.async_fn is None:
        return request
    return request._replace(async_fn=FaultyCall(request.async_fn, faults, rank))


class FaultyWriter(FileSystemWriterAsync):
    """:class:`FileSystemWriterAsync` with ``faults`` in every phase of its save.

    Storage faults fire in the trainer during set-up (``MAKEDIRS``) and while committing
    (``.metadata``), and in the background process while writing data files. One writer
    per save, as with its base class.
    """

    def __init__(self, path: Any, *args: Any, faults: Fault | Sequence[Fault] = (), **kwargs: Any):
        super().__init__(path, *args, **kwargs)
        self.faults = as_faults(faults)
        self._injector = Injector(self.faults, 0)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        rank = kwargs.get("rank")
        self._injector = Injector(self.faults, current_rank() if rank is None else int(rank))
        self._injector.fire(Phase.MAKEDIRS, self.checkpoint_dir)
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)

    def get_save_function_and_args(self) -> tuple[Any, Any, list]:
        save_fn, preload_fn, args = super().get_save_function_and_args()
        if save_fn is not None and self.faults:
            save_fn = FaultyCall(save_fn, self.faults, self._rank())
        return save_fn, preload_fn, args

    def finish(self, metadata: Any, results: Any, file_checksums: Any = None) -> None:
        plain = self._backend
        self._backend = FaultyBackend(plain, self._injector)
        try:
            with installed(self._injector):
                super().finish(metadata, results, file_checksums=file_checksums)
        finally:
            self._backend = plain


class FaultyLocalCheckpointManager(LocalCheckpointManager):
    """:class:`LocalCheckpointManager` whose copy writes run under ``faults``.

    Local checkpoints are written with plain file I/O (node-local POSIX storage), so the
    call phases apply: each call writing copies (the worker's for an async save, the
    trainer's for a synchronous one, the replication thread's for a replicated async one)
    runs as a :class:`FaultyCall`. Assign ``manager.faults`` to change them between saves.
    """

    def __init__(self, *args: Any, faults: Fault | Sequence[Fault] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.faults = as_faults(faults)

    def _write_request(self, iteration: int, ckpt_ids: Sequence[Any]) -> tuple[Any, list[Any]]:
        write_fn, targets = super()._write_request(iteration, ckpt_ids)
        if self.faults:
            write_fn = FaultyCall(write_fn, self.faults, self.rank)
        return write_fn, targets
