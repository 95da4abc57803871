"""The library's exception classes, less the ``Rank*`` family: one hierarchy rooted at
:class:`CheckpointingException`, importable without torch's DCP.

Everyone imports them from :mod:`resilient_ckpt.errors`, which also hands out the ``Rank*``
classes of :mod:`._rank_errors` (loaded on first use: they derive from torch's
``CheckpointException``). They live here, not in ``errors``, because the ``Rank*`` classes
derive from them while ``errors`` hands the ``Rank*`` classes out: defined in ``errors``,
the two modules would import each other. Each class names ``resilient_ckpt.errors`` as its
``__module__``, the path it is documented under, shown in tracebacks and pickled by.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence


class CheckpointingException(Exception):
    """Base class of every error raised by resilient_ckpt."""


class ConfigurationError(CheckpointingException, ValueError):
    """An argument, option or environment variable has an invalid value."""


class InvalidRequestError(CheckpointingException, ValueError):
    """An :class:`~resilient_ckpt.async_ckpt.core.AsyncRequest` cannot be executed as given."""


class MainModuleError(InvalidRequestError):
    """A request refers to a function or class of the trainer's ``__main__`` module that the
    background worker cannot import (``qualname``: its name there, e.g. ``save_fn``).

    Raised in the worker, so the trainer sees it inside the request's
    :class:`AsyncCallFailedError`; the message says what to do.
    """

    def __init__(self, message: str, *, qualname: str = "") -> None:
        super().__init__(message)
        self.qualname = qualname

    def __reduce__(self) -> tuple:
        return _rebuild_main_module_error, (str(self), self.qualname)


def _rebuild_main_module_error(message: str, qualname: str) -> MainModuleError:
    return MainModuleError(message, qualname=qualname)


class FrozenRequestError(CheckpointingException, RuntimeError):
    """A finalize function was added to a frozen (already scheduled) request."""


class QueueClosedError(CheckpointingException, RuntimeError):
    """The async queue was used after ``close()``."""


class StagingError(CheckpointingException):
    """The state could not be snapshotted into host staging memory."""


class WorkerError(CheckpointingException):
    """An async request failed in the background.

    Raised on every rank as :class:`RankAsyncCallFailedError` / :class:`RankWorkerDiedError`
    (subclasses of the classes below and of :class:`RankFailureError`).
    """

    def __init__(
        self, message: str, *, call_idx: int | None = None, failed_ranks: Sequence[int] = ()
    ) -> None:
        super().__init__(message)
        self.call_idx = call_idx
        self.failed_ranks = tuple(failed_ranks)


class WorkerDiedError(WorkerError):
    """The background worker process exited while a request was in flight."""

    def __init__(
        self,
        message: str,
        *,
        exitcode: int | None = None,
        call_idx: int | None = None,
        failed_ranks: Sequence[int] = (),
    ) -> None:
        super().__init__(message, call_idx=call_idx, failed_ranks=failed_ranks)
        self.exitcode = exitcode


class AsyncCallFailedError(WorkerError):
    """``async_fn`` (or ``preload_fn``) raised inside the background worker."""


class CheckpointTimeoutError(CheckpointingException, TimeoutError):
    """A wait exceeded its deadline (see :mod:`resilient_ckpt.config`)."""


class RemoteTraceback(Exception):
    """Carries the text of a traceback from another process, for exception chaining."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f'\n"""\n{self.tb}"""'


class RemoteExceptionError(CheckpointingException):
    """Stands in for an exception that could not be pickled to travel to another rank:
    its qualified type name, message and traceback text."""

    def __init__(self, message: str, *, exc_type: str = "", traceback_text: str = "") -> None:
        super().__init__(message)
        self.exc_type = exc_type
        self.traceback_text = traceback_text

    def __reduce__(self) -> tuple:
        return _rebuild_remote_exception, (str(self), self.exc_type, self.traceback_text)


def _rebuild_remote_exception(message: str, exc_type: str, tb: str) -> RemoteExceptionError:
    return RemoteExceptionError(message, exc_type=exc_type, traceback_text=tb)


class StorageError(CheckpointingException, OSError):
    """Reading or writing checkpoint storage failed."""


class ObjectStoreError(StorageError):
    """An object-store operation failed for good: a permanent error, or transient errors
    until the retry policy gave up. Names the operation, the object and the last error."""

    def __init__(
        self,
        message: str,
        *,
        operation: str,
        key: str,
        attempts: int,
        last_error: BaseException | None = None,
    ) -> None:
        super().__init__(message)
        self.operation = operation
        self.key = key
        self.attempts = attempts
        self.last_error = last_error

    def __reduce__(self) -> tuple:
        # Travels from the background worker to the trainer; the cause's text is in the
        # message, the object itself may not pickle.
        return _rebuild_object_store_error, (
            type(self),
            str(self),
            self.operation,
            self.key,
            self.attempts,
        )


def _rebuild_object_store_error(
    cls: type[ObjectStoreError], message: str, operation: str, key: str, attempts: int
) -> ObjectStoreError:
    return cls(message, operation=operation, key=key, attempts=attempts)


class CorruptCheckpointError(CheckpointingException):
    """A checkpoint file failed its size or checksum verification."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class NoCheckpointError(CheckpointingException, FileNotFoundError):
    """A reader was pointed at a directory that holds no checkpoint (no commit record: an
    empty directory, a save that never committed, a wrong path). ``path`` is the directory.
    Also a ``FileNotFoundError``, as the missing file raised before."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path

    def __reduce__(self) -> tuple:
        return _rebuild_no_checkpoint, (type(self), str(self), self.path)


def _rebuild_no_checkpoint(
    cls: type[NoCheckpointError], message: str, path: str | None
) -> NoCheckpointError:
    return cls(message, path=path)


class VerificationFailedError(CorruptCheckpointError):
    """A readable checkpoint failed its checks (a size, a checksum) and a tool that would
    carry its bytes on (``resilient-ckpt convert``) refused it; the message names what
    failed and how to override."""


class UnsafeCheckpointError(CheckpointingException, pickle.UnpicklingError):
    """A checkpoint file asked for a global that its kind of file never holds.

    Raised by :mod:`resilient_ckpt._restricted_pickle` instead of importing it: the file is
    damaged, of another kind, or built to run code. ``path`` is the file, ``name`` the global
    (``"module.qualname"``). Also an ``UnpicklingError``, as ``torch.load(weights_only=True)``
    raises for the same.
    """

    def __init__(self, message: str, *, path: str | None = None, name: str = "") -> None:
        super().__init__(message)
        self.path = path
        self.name = name


class SameMachineReplicationException(CheckpointingException):
    """A local checkpoint write would overwrite an existing copy of the same checkpoint.

    NVRx name and signature. Raised when one rank would store two copies of one checkpoint
    id (overlapping replication cliques), or the file already exists committed.
    """

    def __init__(self, ckpt_id: object) -> None:
        super().__init__(
            f"checkpoint {ckpt_id!r} already exists on this machine; a rank cannot hold two "
            "copies of one shard (check the replication groups) and a committed iteration is "
            "never overwritten"
        )
        self.ckpt_id = ckpt_id


class NoReplicasAvailableError(CheckpointingException):
    """No rank of the replication group holds a valid copy of a requested checkpoint shard."""


class CheckpointWriteError(CheckpointingException):
    """One rank's background write of a distributed checkpoint failed (or left no result).

    Raised in the trainer by ``retrieve_write_results``; ``save_state_dict_async_finalize``
    agrees it into :class:`RankFailureError` on every rank. Picklable with its attributes.
    """

    def __init__(self, message: str, *, rank: int | None = None, path: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.path = path

    def __reduce__(self) -> tuple:
        return _rebuild_write_error, (type(self), str(self), self.rank, self.path)


def _rebuild_write_error(
    cls: type[CheckpointWriteError], message: str, rank: int | None, path: str | None
) -> CheckpointWriteError:
    return cls(message, rank=rank, path=path)


class CheckpointReadError(StorageError):
    """A rank could not read (or verify) a checkpoint data file that a load needed from it.

    Raised by a read-once load (:mod:`resilient_ckpt.async_ckpt._read_once`) on the failing
    rank, then agreed: every rank raises :class:`RankCheckpointReadError` naming the failed
    ranks. ``rank`` is the failing rank, ``path`` the file (relative to the checkpoint).
    """

    def __init__(self, message: str, *, rank: int | None = None, path: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.path = path

    def __reduce__(self) -> tuple:
        return _rebuild_read_error, (type(self), str(self), self.rank, self.path)


def _rebuild_read_error(
    cls: type[CheckpointReadError], message: str, rank: int | None, path: str | None
) -> CheckpointReadError:
    return cls(message, rank=rank, path=path)


class CheckpointExistsError(CheckpointingException, FileExistsError):
    """A committed checkpoint already exists where a writer with ``overwrite=False`` writes."""


for _value in list(globals().values()):
    if isinstance(_value, type) and _value.__module__ == __name__:
        _value.__module__ = "resilient_ckpt.errors"
del _value
