"""A ``torch.distributed.checkpoint`` file system over a storage backend, with read-ahead.

torch's ``FileSystemReader`` does all its I/O through a small ``FileSystemBase`` object
(open a stream, join paths, check existence). :class:`BackendFileSystem` implements it with
a :class:`~.base.StorageBackend`, so torch's own reader logic loads checkpoints from object
stores, with the backend's retries, without a copy of that logic here.

Read-ahead. torch reads the data files of a load plan one after the other; on an object
store each is a network download, so one rank would use one connection at a time. Before a
load, :meth:`BackendFileSystem.read_ahead` starts downloading the plan's files, in torch's
order, on a few threads, keeping at most that many downloaded-but-unread files in memory;
``create_stream`` then hands out each downloaded buffer and starts the next download.

Each object handed out for reading is counted whole (``on_read``): the backends download an
object whole, so that is what a load read from storage.

Rename is the one operation an object store lacks; readers never rename, and our writer
commits without it (see :mod:`.msc`), so ``rename`` raises.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint.filesystem import FileSystemBase

from ..errors import StorageError
from .base import StorageBackend


class _ReadAhead:
    """Downloads ``paths`` in order on ``threads`` threads, ``threads`` files ahead at most."""

    def __init__(self, download: Any, paths: list[str], threads: int) -> None:
        self._download = download
        self._pending = deque(paths)
        self._window = max(1, threads)
        self._futures: dict[str, Future[BinaryIO]] = {}
        self._pool = ThreadPoolExecutor(self._window, thread_name_prefix="resilient_ckpt-read")
        self._fill()

    def _fill(self) -> None:
        while self._pending and len(self._futures) < self._window:
            path = self._pending.popleft()
            if path not in self._futures:
                self._futures[path] = self._pool.submit(self._download, path)

    def take(self, path: str) -> BinaryIO | None:
        future = self._futures.pop(path, None)
        self._fill()
        return future.result() if future is not None else None

    def close(self) -> None:
        self._pending.clear()
        for future in self._futures.values():
            future.cancel()
        self._pool.shutdown(wait=True)
        for future in self._futures.values():
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().close()
        self._futures.clear()


class BackendFileSystem(FileSystemBase):
    """``FileSystemBase`` whose paths are backend paths (strings, e.g. ``msc://...``)."""

    def __init__(
        self, backend: StorageBackend, on_read: Callable[[int], None] | None = None
    ) -> None:
        self.backend = backend
        # Told the size of every object read (an object is downloaded whole): a load's count.
        self.on_read = on_read
        self._read_ahead: _ReadAhead | None = None

    def read_ahead(self, paths: list[str], threads: int) -> None:
        """Start downloading ``paths`` (needs a backend with ``download``); see module doc."""
        self.stop_read_ahead()
        download = getattr(self.backend, "download", None)
        if download is not None and threads > 1 and len(paths) > 1:
            self._read_ahead = _ReadAhead(download, paths, threads)

    def stop_read_ahead(self) -> None:
        if self._read_ahead is not None:
            self._read_ahead.close()
            self._read_ahead = None

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        path = str(path)
        if mode == "rb":
            buffer = self._read_ahead.take(path) if self._read_ahead is not None else None
            if buffer is None:
                with self.backend.open_read(path) as stream:
                    self._count(stream)
                    yield stream
                return
            try:
                self._count(buffer)
                yield buffer
            finally:
                buffer.close()
        elif mode == "wb":
            with self.backend.open_write(path) as stream:
                yield stream
        else:
            raise StorageError(f"unsupported stream mode {mode!r} for {path}")

    def read_bytes(self, path: str) -> torch.Tensor:
        """The whole object at ``path`` as a uint8 tensor (taken from the read-ahead when it
        downloaded it)."""
        with self.create_stream(path, "rb") as stream:
            stream.seek(0, os.SEEK_END)
            size = stream.tell()
            stream.seek(0)
            data = torch.empty(size, dtype=torch.uint8)
            view: Any = data.numpy()
            got = stream.readinto(memoryview(view)) if size else 0
        if got != size:
            raise StorageError(f"{path}: read {got} of its {size} bytes")
        return data

    def _count(self, stream: Any) -> None:
        if self.on_read is None:
            return
        position = stream.tell()
        self.on_read(stream.seek(0, os.SEEK_END) - position)
        stream.seek(position)

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return self.backend.join(str(path), suffix)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        raise StorageError(
            f"cannot rename {path} to {new_path}: object stores have no rename (write the "
            "final name directly; it appears when the upload completes)"
        )

    def init_path(self, path: str | os.PathLike) -> str:
        return str(path)

    def mkdir(self, path: str | os.PathLike) -> None:
        self.backend.makedirs(str(path))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def exists(self, path: str | os.PathLike) -> bool:
        return self.backend.exists(str(path))

    def rm_file(self, path: str | os.PathLike) -> None:
        self.backend.delete(str(path))

    def ls(self, path: str | os.PathLike) -> list[str]:
        return [self.backend.join(str(path), name) for name in self.backend.list(str(path))]
