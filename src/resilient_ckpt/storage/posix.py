"""POSIX backend: durable, atomic writes on a local or shared file system."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import BinaryIO

from ..errors import StorageError
from .base import Listing, StorageBackend
from .commit import atomic_file, fsync_dir


def probe_writable(directory: str, what: str = "checkpoint directory") -> None:
    """Create and remove a file in ``directory``: the one reliable test that it is writable
    (root ignores permission bits; a read-only mount or a full inode table shows only
    here). Raises :class:`StorageError` naming ``what`` and the directory."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".resilient_ckpt_probe-", dir=directory)
    except OSError as exc:
        raise StorageError(f"{what} {directory!r} is not writable: {exc.strerror or exc}") from exc
    os.close(fd)
    os.unlink(probe)


class PosixBackend(StorageBackend):
    scheme = "file"

    def makedirs(self, path: str) -> None:
        try:
            os.makedirs(path, exist_ok=True)
        except FileExistsError as exc:
            raise StorageError(f"{path!r} exists and is not a directory") from exc
        except OSError as exc:
            raise StorageError(f"cannot create directory {path!r}: {exc.strerror}") from exc

    def open_write(self, path: str, *, sync: bool = True) -> AbstractContextManager[BinaryIO]:
        return atomic_file(path, sync=sync)  # type: ignore[return-value]

    @contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        with open(path, "rb") as f:
            yield f

    def list(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def scan(self, path: str) -> Listing:
        listing = Listing()
        try:
            with os.scandir(path) as entries:
                for entry in entries:
                    try:
                        if entry.is_dir():
                            listing.dirs.append(entry.name)
                        elif entry.is_file():
                            listing.files[entry.name] = entry.stat().st_size
                    except FileNotFoundError:  # removed while we looked
                        continue
        except (FileNotFoundError, NotADirectoryError):
            pass
        listing.dirs.sort()
        return listing

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)

    def size(self, path: str) -> int:
        return os.path.getsize(path)

    def delete(self, path: str, *, recursive: bool = False, sync: bool = False) -> None:
        try:
            if recursive and os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            return
        if sync:
            fsync_dir(os.path.dirname(os.path.abspath(path)))

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)
