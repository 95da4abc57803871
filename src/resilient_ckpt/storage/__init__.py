"""Storage backends: where checkpoint bytes go.

:mod:`.base` is the interface, :mod:`.backends` chooses one by URL, :mod:`.commit`
makes written bytes a checkpoint (and unmakes it), :mod:`.retention` prunes old ones and
finds the newest to resume from.
"""

from .backends import get_backend, set_backend_wrapper
from .base import Listing, StorageBackend, is_msc_url, is_url
from .posix import PosixBackend
from .retention import CheckpointRef, latest_checkpoint, list_checkpoints, prune_checkpoints

__all__ = [
    "CheckpointRef",
    "Listing",
    "PosixBackend",
    "StorageBackend",
    "get_backend",
    "is_msc_url",
    "is_url",
    "latest_checkpoint",
    "list_checkpoints",
    "prune_checkpoints",
    "set_backend_wrapper",
]
