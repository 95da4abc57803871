"""Storage backends: where checkpoint bytes go. See :mod:`.base` for the interface."""

from .base import StorageBackend, get_backend, is_url, set_backend_wrapper
from .posix import PosixBackend

__all__ = ["PosixBackend", "StorageBackend", "get_backend", "is_url", "set_backend_wrapper"]
