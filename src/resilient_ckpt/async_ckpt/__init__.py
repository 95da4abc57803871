"""Asynchronous checkpointing: the queue, its callers, and async ``torch.save``."""

from .core import (
    AsyncCaller,
    AsyncCallsQueue,
    AsyncRequest,
    PersistentAsyncCaller,
    TemporalAsyncCaller,
    abort_nvrx_checkpoint,
)
from .torch_ckpt import TorchAsyncCheckpoint

__all__ = [
    "AsyncCallsQueue",
    "AsyncCaller",
    "AsyncRequest",
    "PersistentAsyncCaller",
    "TemporalAsyncCaller",
    "TorchAsyncCheckpoint",
    "abort_nvrx_checkpoint",
]
