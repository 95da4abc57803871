"""Damaged files and full disks.

:func:`flip_byte` changes one byte of a checkpoint file in place (silent corruption, as a
bad disk or a bit flip in a page cache would leave it); :func:`truncate` cuts a file short
(a torn write). :func:`small_filesystem` mounts a size-limited ``tmpfs`` for a test, so a
save runs into a real ``ENOSPC`` from the kernel at whatever point the space runs out, and
:func:`fill_filesystem` leaves a chosen number of bytes free on it. Mounting needs root (or
CAP_SYS_ADMIN) and a sandbox that allows it; where it is not allowed
:class:`MountUnavailable` says why, so a test can skip with that reason (and fall back to
``Fault(Phase.WRITE, Action.RAISE, errno=errno.ENOSPC)``, which raises the same error from
the storage layer).
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

from ...errors import CheckpointingException, ConfigurationError


class MountUnavailable(CheckpointingException):
    """A test file system could not be mounted here; the message says why."""


def flip_byte(path: str, offset: int | None = None, *, rng: random.Random | None = None) -> int:
    """Invert every bit of one byte of ``path`` (at ``offset``, default: a random one);
    returns the offset."""
    size = os.path.getsize(path)
    if size == 0:
        raise ConfigurationError(f"{path} is empty: there is no byte to flip")
    if offset is None:
        offset = (rng or random.Random()).randrange(size)
    if not 0 <= offset < size:
        raise ConfigurationError(f"offset {offset} is outside {path} ({size} bytes)")
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(1)
        f.seek(offset)
        f.write(bytes([old[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())
    return offset


def truncate(path: str, remove: int = 1) -> int:
    """Cut the last ``remove`` bytes off ``path``; returns the new size."""
    size = max(0, os.path.getsize(path) - remove)
    with open(path, "r+b") as f:
        f.truncate(size)
    return size


def _run(*command: str) -> str | None:
    """Run a command; None on success, else why it failed."""
    if shutil.which(command[0]) is None:
        return f"no {command[0]!r} command on this machine"
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode == 0:
        return None
    return (done.stderr or done.stdout).strip() or f"{command[0]} exited with {done.returncode}"


@contextmanager
def small_filesystem(path: str, size_bytes: int) -> Iterator[str]:
    """Mount a ``tmpfs`` of ``size_bytes`` at ``path`` (created if needed) for the block.

    Raises :class:`MountUnavailable` with the reason when mounting is not permitted.
    """
    if size_bytes < 4096:
        raise ConfigurationError(f"size_bytes must be at least one page, got {size_bytes}")
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0:
        raise MountUnavailable("mounting a tmpfs needs root; this process is not root")
    why = _run("mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0777", "tmpfs", path)
    if why is not None:
        raise MountUnavailable(f"mount -t tmpfs is not permitted here: {why}")
    try:
        yield path
    finally:
        if _run("umount", path) is not None:
            _run("umount", "-l", path)  # still busy (a process has a file open): detach


def free_bytes(path: str) -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def fill_filesystem(path: str, leave_free: int, name: str = ".filler") -> str:
    """Write a file under ``path`` until at most ``leave_free`` bytes stay free; returns
    its path (delete it to free the space)."""
    filler = os.path.join(path, name)
    chunk = b"\0" * (1 << 20)
    with open(filler, "ab", buffering=0) as f:
        while True:
            excess = free_bytes(path) - leave_free
            if excess <= 0:
                break
            try:
                f.write(chunk[: min(len(chunk), excess)])
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    break
                raise
    return filler
