"""Durable file writes: temporary name, fsync, atomic rename, directory fsync."""

from __future__ import annotations

import os
from collections.abc import Callable
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


def write_atomically(path: str, write: Callable[[IO[bytes]], None], sync: bool = True) -> None:
    """Write ``path`` through ``write(f)``: readers see the old file or the whole new one."""
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
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
    if sync:
        fsync_dir(os.path.dirname(os.path.abspath(path)))
