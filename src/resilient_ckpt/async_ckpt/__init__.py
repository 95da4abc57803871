"""Asynchronous checkpointing: the queue, its callers, async ``torch.save`` and async DCP.

The DCP names are imported on first use: ``torch.distributed.checkpoint`` and DTensor are
slow to import, and every background worker imports this package at start-up.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .core import (
    AsyncCaller,
    AsyncCallsQueue,
    AsyncRequest,
    PersistentAsyncCaller,
    TemporalAsyncCaller,
    abort_nvrx_checkpoint,
)
from .torch_ckpt import TorchAsyncCheckpoint

if TYPE_CHECKING:
    from .cached_metadata_filesystem_reader import (
        CachedMetadataFileSystemReader,
        clear_metadata_cache,
    )
    from .filesystem_async import FileSystemWriterAsync
    from .state_dict_saver import (
        CheckpointMetadataCache,
        save_state_dict_async_finalize,
        save_state_dict_async_plan,
    )
    from .verify import VerifiedCheckpoint, verify_checkpoint

_LAZY = {
    "CachedMetadataFileSystemReader": ".cached_metadata_filesystem_reader",
    "clear_metadata_cache": ".cached_metadata_filesystem_reader",
    "FileSystemWriterAsync": ".filesystem_async",
    "CheckpointMetadataCache": ".state_dict_saver",
    "save_state_dict_async_finalize": ".state_dict_saver",
    "save_state_dict_async_plan": ".state_dict_saver",
    "VerifiedCheckpoint": ".verify",
    "verify_checkpoint": ".verify",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "AsyncCallsQueue",
    "AsyncCaller",
    "AsyncRequest",
    "CachedMetadataFileSystemReader",
    "CheckpointMetadataCache",
    "FileSystemWriterAsync",
    "PersistentAsyncCaller",
    "TemporalAsyncCaller",
    "TorchAsyncCheckpoint",
    "VerifiedCheckpoint",
    "abort_nvrx_checkpoint",
    "clear_metadata_cache",
    "save_state_dict_async_finalize",
    "save_state_dict_async_plan",
    "verify_checkpoint",
]
