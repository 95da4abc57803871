"""resilient_ckpt: fast, safe checkpointing for PyTorch distributed training.

An independent implementation of the checkpointing API of NVIDIA's Resiliency Extension
(replace the import prefix ``nvidia_resiliency_ext.checkpointing`` by ``resilient_ckpt``).
"""

from .async_ckpt.core import AsyncCallsQueue, AsyncRequest, abort_nvrx_checkpoint
from .async_ckpt.torch_ckpt import TorchAsyncCheckpoint
from .config import Timeouts
from .errors import CheckpointingException

__version__ = "0.1.0"

__all__ = [
    "AsyncCallsQueue",
    "AsyncRequest",
    "CheckpointingException",
    "Timeouts",
    "TorchAsyncCheckpoint",
    "__version__",
    "abort_nvrx_checkpoint",
]
