"""Asynchronous checkpointing: the queue, its callers, async ``torch.save`` and async DCP."""

from .cached_metadata_filesystem_reader import CachedMetadataFileSystemReader, clear_metadata_cache
from .core import (
    AsyncCaller,
    AsyncCallsQueue,
    AsyncRequest,
    PersistentAsyncCaller,
    TemporalAsyncCaller,
    abort_nvrx_checkpoint,
)
from .filesystem_async import FileSystemWriterAsync
from .state_dict_saver import (
    CheckpointMetadataCache,
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from .torch_ckpt import TorchAsyncCheckpoint
from .verify import VerifiedCheckpoint, verify_checkpoint

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
