"""Which backend serves a path: chosen by the path's URL scheme, wrapped on request.

:func:`get_backend`: a plain path selects POSIX (:mod:`.posix`), ``msc://<profile>/<key>``
(or ``use_msc=True``) the object-store backend (:mod:`.msc`); any other URL is refused with
what to write instead. Backends are imported when first chosen, so an optional client library
is needed only when its scheme is used; a new backend gets its scheme here. This module sits
above the backends (they implement :mod:`.base`, the interface, and know nothing of the
choice), so the choice can import them and nothing imports back.

Instrumentation: :func:`set_backend_wrapper` routes every backend :func:`get_backend` hands
out in this process through a wrapper (the fault-injection kit,
:mod:`resilient_ckpt.testing.faults`, wraps the chosen backend to fail, delay or corrupt
operations). A wrapper, not a subclass per backend, so it composes with any backend,
including ones added later, and the backends stay free of test code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import ConfigurationError
from .base import StorageBackend, is_url
from .posix import PosixBackend

if TYPE_CHECKING:
    from ..config import RetryPolicy


BackendWrapper = Callable[[StorageBackend, str], StorageBackend]
_backend_wrapper: BackendWrapper | None = None


def set_backend_wrapper(wrapper: BackendWrapper | None) -> BackendWrapper | None:
    """Make :func:`get_backend` return ``wrapper(backend, path)`` in this process (None:
    plain backends again); returns the previous wrapper, to restore it."""
    global _backend_wrapper
    previous, _backend_wrapper = _backend_wrapper, wrapper
    return previous


def get_backend(
    path: str, *, use_msc: bool = False, retry: RetryPolicy | None = None
) -> StorageBackend:
    """The backend for ``path``: ``msc://...`` (or ``use_msc``) -> MSC, else POSIX.

    For an ``msc://`` path the profile is resolved here, so a missing package, config file
    or profile raises :class:`~resilient_ckpt.errors.ConfigurationError` saying what to set.
    ``retry`` overrides the process-wide retry policy of object-store operations.
    """
    backend = _select_backend(path, use_msc, retry)
    wrapper = _backend_wrapper
    return backend if wrapper is None else wrapper(backend, str(path))


def _select_backend(path: str, use_msc: bool, retry: RetryPolicy | None) -> StorageBackend:
    path = str(path)
    if path.startswith("msc://") or use_msc:
        if not path.startswith("msc://") and is_url(path):
            raise ConfigurationError(
                f"use_msc=True takes an msc://<profile>/<path> URL or a local path, got {path!r}"
            )
        from .msc import MscBackend  # optional client library: imported on first use

        backend = MscBackend(retry=retry)
        backend.check(path)
        return backend
    if is_url(path):
        raise ConfigurationError(
            f"unsupported storage URL {path!r}: use a local path or msc://<profile>/<path>"
        )
    return PosixBackend()
