"""The storage backend interface: the few operations a checkpoint needs from storage.

Call protocol. Writers call ``makedirs`` for a checkpoint directory, then ``open_write``
once per artifact; an artifact becomes visible to ``exists``/``list``/``open_read`` only when
its ``open_write`` block exits without an exception (POSIX: temporary name, fsync, atomic
rename, directory fsync; object stores: the upload completes or nothing is stored). The
*commit record* of a checkpoint (DCP's ``.metadata``, a local manifest, a marker object) is
written last, with ``open_write`` as well, only after every other artifact succeeded:
readers treat a checkpoint without its commit record as absent. Retention calls ``delete``
only on checkpoints older than one that is committed.

Paths are strings. A POSIX path is a plain path; an object-store path is a URL whose scheme
selects the backend (``msc://profile/key``): :mod:`.backends` chooses it, above the
backends, which implement this interface.

Directories. Object stores have none, only key prefixes: there ``makedirs`` does nothing,
a "directory" exists while some object lies below it, and ``scan`` reports the next level
of names below a prefix with the sizes the listing already carries, so a tool that walks a
tree of checkpoints makes one request per level instead of one per object.

Commits (a checkpoint's record written last, uncommit, batches of renames) are built on
these operations in :mod:`.commit`, the same way for every backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import BinaryIO


@dataclass
class Listing:
    """One level below a directory: sub-directory names, and file names with their sizes."""

    dirs: list[str] = field(default_factory=list)
    files: dict[str, int] = field(default_factory=dict)


class StorageBackend(ABC):
    """Nine operations; implementations must make ``open_write`` all-or-nothing."""

    scheme: str = ""

    @abstractmethod
    def makedirs(self, path: str) -> None:
        """Create a directory and its parents (no-op where directories are implicit)."""

    @abstractmethod
    def open_write(self, path: str, *, sync: bool = True) -> AbstractContextManager[BinaryIO]:
        """A binary stream; its content appears at ``path`` atomically on clean exit.

        ``sync=False`` skips fsync (faster, not crash-durable); object stores ignore it.
        """

    @abstractmethod
    def open_read(self, path: str) -> AbstractContextManager[BinaryIO]:
        """A binary stream over the whole artifact at ``path``."""

    @abstractmethod
    def scan(self, path: str) -> Listing:
        """The entries directly under directory ``path`` (empty if absent or a file)."""

    def list(self, path: str) -> list[str]:
        """Names (not paths) of the entries directly under directory ``path``; [] if absent."""
        listing = self.scan(path)
        return sorted([*listing.dirs, *listing.files])

    @abstractmethod
    def exists(self, path: str) -> bool:
        """An artifact or a (non-empty, on object stores) directory is at ``path``."""

    @abstractmethod
    def is_dir(self, path: str) -> bool: ...

    @abstractmethod
    def size(self, path: str) -> int: ...

    @abstractmethod
    def delete(self, path: str, *, recursive: bool = False, sync: bool = False) -> None:
        """Remove an artifact (or a whole directory with ``recursive``); absent is fine.

        ``sync=True``: the removal survives a crash once this returns (POSIX fsyncs the
        parent directory; on object stores a completed delete is durable anyway).
        """

    def join(self, *parts: str) -> str:
        head, *rest = parts
        for part in rest:
            head = head.rstrip("/") + "/" + part.lstrip("/")
        return head

    def walk_files(self, path: str) -> Iterator[str]:
        """Every artifact path below ``path`` (files of a level first, then sub-directories)."""
        listing = self.scan(path)
        for name in sorted(listing.files):
            yield self.join(path, name)
        for name in sorted(listing.dirs):
            yield from self.walk_files(self.join(path, name))


def is_url(path: str) -> bool:
    return "://" in str(path)


def is_msc_url(path: object) -> bool:
    return isinstance(path, str) and path.startswith("msc://")
