"""One exception hierarchy for the whole library.

Every error derives from :class:`CheckpointingException` (NVRx's base class name, so
``except CheckpointingException`` in NVRx code keeps working); where NVRx raised a builtin
(``RuntimeError`` for a frozen request, ``ValueError`` for bad arguments) ours derives from it
too. Errors carry structure (rank, call index, path) as attributes, say what to do, and chain
their cause.

A step that failed on some ranks raises :class:`RankFailureError` (or a subclass keeping the
class callers catch) on every rank; those classes also derive from torch's
``CheckpointException`` and live in :mod:`._rank_errors`, loaded here on first use, because
that import pulls in ``torch.distributed.checkpoint``, which background workers must not pay.
The other classes are defined in :mod:`._exceptions`, below both this module and
``_rank_errors``, so that imports flow one way; this module is where they are all named.
"""

from __future__ import annotations

from typing import Any

from ._exceptions import (
    AsyncCallFailedError,
    CheckpointExistsError,
    CheckpointingException,
    CheckpointReadError,
    CheckpointTimeoutError,
    CheckpointWriteError,
    ConfigurationError,
    CorruptCheckpointError,
    FrozenRequestError,
    InvalidRequestError,
    MainModuleError,
    NoCheckpointError,
    NoReplicasAvailableError,
    ObjectStoreError,
    QueueClosedError,
    RemoteExceptionError,
    RemoteTraceback,
    SameMachineReplicationException,
    StagingError,
    StorageError,
    UnsafeCheckpointError,
    VerificationFailedError,
    WorkerDiedError,
    WorkerError,
)

_RANK_ERRORS = (
    "RankAsyncCallFailedError",
    "RankCheckpointReadError",
    "RankConfigurationError",
    "RankCorruptCheckpointError",
    "RankFailureError",
    "RankInvalidRequestError",
    "RankStorageError",
    "RankUnsafeCheckpointError",
    "RankWorkerDiedError",
)


def __getattr__(name: str) -> Any:
    if name in _RANK_ERRORS:
        from . import _rank_errors

        return getattr(_rank_errors, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The classes defined here; the Rank* ones are named on first use (see the module note).
__all__ = [
    "AsyncCallFailedError",
    "CheckpointExistsError",
    "CheckpointReadError",
    "CheckpointTimeoutError",
    "CheckpointWriteError",
    "CheckpointingException",
    "ConfigurationError",
    "CorruptCheckpointError",
    "FrozenRequestError",
    "InvalidRequestError",
    "MainModuleError",
    "NoCheckpointError",
    "NoReplicasAvailableError",
    "ObjectStoreError",
    "QueueClosedError",
    "RemoteExceptionError",
    "RemoteTraceback",
    "SameMachineReplicationException",
    "StagingError",
    "StorageError",
    "UnsafeCheckpointError",
    "VerificationFailedError",
    "WorkerDiedError",
    "WorkerError",
]
