"""Durable file writes: temporary name, fsync, atomic rename, directory fsync.

One mechanism for every file the library publishes on a POSIX file system (``torch.save``
targets, local manifests, the POSIX storage backend): the content goes to a hidden
temporary name in the same directory, is flushed and fsynced, and is renamed over the final
name, so a reader sees the old file or the whole new one, never a torn one. The directory
fsync that makes the rename itself durable is optional for callers that commit a batch of
renames with one directory fsync of their own.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO


def fsync_dir(path: str) -> None:
    """fsync a directory so a rename inside it survives a crash."""
    fd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(path: str) -> str:
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.tmp-{os.getpid()}")


@contextmanager
def atomic_file(path: str, *, sync: bool = True, sync_dir: bool = True) -> Iterator[IO[bytes]]:
    """A binary file whose content replaces ``path`` atomically when the block exits cleanly.

    On an exception the temporary file is removed and ``path`` is left as it was.
    ``sync=False`` skips every fsync; ``sync_dir=False`` skips only the directory's.
    """
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if sync and sync_dir:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_atomically(path: str, write: Callable[[IO[bytes]], None], sync: bool = True) -> None:
    """Write ``path`` through ``write(f)``: readers see the old file or the whole new one."""
    with atomic_file(path, sync=sync) as f:
        write(f)
