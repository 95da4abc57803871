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
selects the backend (``msc://profile/key``), parsed by :func:`get_backend`. Backends are
imported lazily, so an optional client library is needed only when its scheme is used.

Instrumentation: :func:`set_backend_wrapper` routes every backend :func:`get_backend` hands
out in this process through a wrapper (the fault-injection kit,
:mod:`resilient_ckpt.testing.faults`, wraps the chosen backend to fail, delay or corrupt
operations). A wrapper, not a subclass per backend, so it composes with any backend,
including ones added later, and the backends stay free of test code.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import BinaryIO

from ..errors import ConfigurationError


class StorageBackend(ABC):
    """Seven operations; implementations must make ``open_write`` all-or-nothing."""

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
    def list(self, path: str) -> list[str]:
        """Names (not paths) of the entries directly under directory ``path``; [] if absent."""

    @abstractmethod
    def exists(self, path: str) -> bool: ...

    @abstractmethod
    def size(self, path: str) -> int: ...

    @abstractmethod
    def delete(self, path: str, *, recursive: bool = False) -> None:
        """Remove an artifact (or a whole directory with ``recursive``); absent is fine."""

    def join(self, *parts: str) -> str:
        head, *rest = parts
        for part in rest:
            head = head.rstrip("/") + "/" + part.lstrip("/")
        return head

    def walk_files(self, path: str) -> Iterator[str]:
        """Every artifact path below ``path`` (depth-first), built from ``list``."""
        for name in self.list(path):
            child = self.join(path, name)
            entries = self.list(child)
            if entries:
                yield from self.walk_files(child)
            elif self.exists(child):
                yield child


def is_url(path: str) -> bool:
    return "://" in str(path)


BackendWrapper = Callable[[StorageBackend, str], StorageBackend]
_backend_wrapper: BackendWrapper | None = None


def set_backend_wrapper(wrapper: BackendWrapper | None) -> BackendWrapper | None:
    """Make :func:`get_backend` return ``wrapper(backend, path)`` in this process (None:
    plain backends again); returns the previous wrapper, to restore it."""
    global _backend_wrapper
    previous, _backend_wrapper = _backend_wrapper, wrapper
    return previous


def get_backend(path: str, *, use_msc: bool = False) -> StorageBackend:
    """The backend for ``path``: ``msc://...`` (or ``use_msc``) -> MSC, else POSIX."""
    backend = _select_backend(path, use_msc)
    wrapper = _backend_wrapper
    return backend if wrapper is None else wrapper(backend, str(path))


def _select_backend(path: str, use_msc: bool) -> StorageBackend:
    path = str(path)
    if path.startswith("msc://") or use_msc:
        if not path.startswith("msc://"):
            raise ConfigurationError(
                f"use_msc=True needs an msc://<profile>/<path> URL, got {path!r}"
            )
        from .msc import MscBackend  # type: ignore[import-not-found]  # optional, lazy

        return MscBackend()  # type: ignore[no-any-return]
    if is_url(path):
        raise ConfigurationError(
            f"unsupported storage URL {path!r}: use a local path or msc://<profile>/<path>"
        )
    from .posix import PosixBackend

    return PosixBackend()
