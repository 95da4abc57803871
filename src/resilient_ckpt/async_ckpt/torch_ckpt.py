"""``TorchAsyncCheckpoint``: ``torch.save`` in the background, committed atomically.

``async_save(state_dict, f, ...)`` takes the arguments of ``torch.save``. The state is
snapshotted before the call returns (into the staging arena with the persistent queue; by
the fork's copy-on-write with the fork queue, CUDA tensors moved to the host first). The
worker writes a temporary file, fsyncs it, renames it over ``f`` and fsyncs the directory,
so ``f`` is always either the previous complete file or the new one. An
``msc://<profile>/<key>`` target is uploaded as one object, which appears whole when the
upload completes: the same either-or without a rename.

A trainer killed while its worker writes leaves the worker's temporary file
(``.<name>.tmp-<pid>@<host>``, see :func:`~resilient_ckpt.storage.commit.temp_name`). Each
save into a local folder removes the ones there whose writer is gone (same host, no such
pid): never a live writer's, never a file of another name; those of another host stay, as
whether their writer lives cannot be known here. The writing process does this before it
writes (the worker, for an async save), so the trainer's stall does not grow with the
folder.

Closing. ``finalize_async_save(terminate=True)`` finalizes and stops the worker; calling it
again does nothing. A save after it starts a new worker, as NVRx's queue does (a restarted
trainer reuses the object): it is logged, since a worker start is seconds.
"""

from __future__ import annotations

import functools
import os
from typing import IO, Any

import torch

from .. import _telemetry
from .._logging import get_logger
from ..config import Timeouts
from ..errors import ConfigurationError
from ..storage import get_backend, is_msc_url
from ..storage.commit import remove_stale_temp_files, write_atomically
from ..utils import iter_tensors, preload_tensors
from .core import AsyncCallsQueue, AsyncRequest

logger = get_logger(__name__)


def save_atomically(obj: Any, path: str, *args: Any, sync: bool = True, **kwargs: Any) -> None:
    """``torch.save(obj, path, ...)`` through a temporary file and an atomic rename, after
    removing the temporary files of killed writers next to ``path`` (in the writing
    process: the background worker for an async save, off the trainer's stall)."""
    _remove_leftovers(os.path.dirname(os.path.abspath(path)))

    def _write(f: IO[bytes]) -> None:
        torch.save(obj, f, *args, **kwargs)

    write_atomically(path, _write, sync=sync)


def save_to_storage(obj: Any, path: str, *args: Any, **kwargs: Any) -> None:
    """``torch.save(obj, ...)`` uploaded as one object to ``path`` (an ``msc://`` URL)."""
    backend = get_backend(path)
    with backend.open_write(path) as f:
        torch.save(obj, f, *args, **kwargs)


def _check_target(f: Any) -> str:
    if not isinstance(f, (str, os.PathLike)):
        raise ConfigurationError(
            f"TorchAsyncCheckpoint.async_save needs a file path (str or os.PathLike) as its "
            f"second argument, got {type(f).__name__}: file objects cannot be handed to the "
            "background writer"
        )
    if is_msc_url(f):
        get_backend(str(f))  # resolves the profile now: a bad one fails here, not in the worker
        return str(f)
    path = os.fspath(f)
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigurationError(f"checkpoint path {path!r} is a directory; give a file name")
    if not os.path.isdir(parent):
        raise ConfigurationError(
            f"directory {parent!r} for checkpoint {path!r} does not exist; create it first"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigurationError(f"directory {parent!r} is not writable by this process")
    return path


def _remove_leftovers(directory: str) -> None:
    """Remove the temporary files of killed writers in ``directory`` (module docstring)."""
    for path in remove_stale_temp_files(directory):
        logger.info("removed %s: the temporary file of a save whose writer is gone", path)


class TorchAsyncCheckpoint:
    """Asynchronous ``torch.save`` on top of :class:`AsyncCallsQueue`."""

    async_fn = None

    def __init__(
        self,
        persistent_queue: bool = True,
        *,
        timeouts: Timeouts | None = None,
        sync_files: bool = True,
        copy_threads: int | None = None,
    ) -> None:
        self.persistent_queue = persistent_queue
        self.sync_files = sync_files
        self._terminated = False  # by finalize_async_save(terminate=True) or close()
        self._queue = AsyncCallsQueue(
            persistent=persistent_queue, timeouts=timeouts, copy_threads=copy_threads
        )

    @property
    def queue(self) -> AsyncCallsQueue:
        return self._queue

    @property
    def _async_calls_queue(self) -> AsyncCallsQueue:
        """NVRx's attribute name for the queue."""
        return self._queue

    def _get_async_calls_queue(self) -> AsyncCallsQueue:
        """The queue behind this object (NVRx name; tests and tools inspect its worker)."""
        return self._queue

    def save(self, state_dict: Any, *args: Any, **kwargs: Any) -> None:
        """Synchronous ``torch.save(state_dict, *args, **kwargs)`` (NVRx: used next to
        :meth:`async_save`), committed as :meth:`async_save` commits (fsynced unless
        ``sync_files=False``); a file object is handed to ``torch.save`` as it is.
        """
        if args:
            f, rest = args[0], args[1:]
        elif "f" in kwargs:
            f, rest = kwargs.pop("f"), ()
        else:
            raise ConfigurationError("TorchAsyncCheckpoint.save needs a target `f`")
        if not isinstance(f, (str, os.PathLike)):
            torch.save(state_dict, f, *rest, **kwargs)
            return
        path = _check_target(f)
        if is_msc_url(path):
            save_to_storage(state_dict, path, *rest, **kwargs)
        else:
            save_atomically(state_dict, path, *rest, sync=self.sync_files, **kwargs)

    def warmup(self, state_dict: Any) -> None:
        """Start the worker and size a staging arena for ``state_dict`` ahead of the first save (see
        ``AsyncCallsQueue.warmup``).
        """
        self._queue.warmup(state_dict)

    def wait_for_snapshot(self, timeout: float | None = None) -> None:
        """After ``async_save(..., overlap_staging=True)``: wait until the tensors are
        copied; call it before the saved tensors change (before ``optimizer.step()``)."""
        self._queue.wait_for_snapshot(timeout)

    def async_save(
        self, state_dict: Any, *args: Any, overlap_staging: bool = False, **kwargs: Any
    ) -> int:
        """Start saving ``state_dict`` like ``torch.save(state_dict, *args, **kwargs)``.

        With ``overlap_staging=True`` it returns before the tensors are copied; call
        :meth:`wait_for_snapshot` before they change. With ``persistent_queue=False`` the fork is
        the snapshot, so the flag changes nothing there.
        """
        if args:
            f, rest = args[0], args[1:]
        elif "f" in kwargs:
            f, rest = kwargs.pop("f"), ()
        else:
            raise ConfigurationError("TorchAsyncCheckpoint.async_save needs a target path `f`")
        path = _check_target(f)
        _telemetry.prepare_save("torch", **{_telemetry.CHECKPOINT: path})
        if is_msc_url(path):
            save_fn: Any = save_to_storage
        else:
            save_fn = functools.partial(save_atomically, sync=self.sync_files)
        if not self.persistent_queue and any(
            t.device.type != "cpu" for t in iter_tensors(state_dict)
        ):
            # A forked child cannot read device memory: host copies first, as NVRx does. (Not
            # a preload_fn: its result replaces the request's second argument, the path.)
            state_dict = preload_tensors(state_dict, non_blocking=True)  # synchronizes
        if self._terminated:
            logger.info(
                "TorchAsyncCheckpoint.async_save after close or finalize_async_save("
                "terminate=True): starting a new background worker"
            )
            self._terminated = False
        request = AsyncRequest(save_fn, (state_dict, path, *rest), [], kwargs)
        return self._queue.schedule_async_request(request, overlap_staging=overlap_staging)

    def finalize_async_save(
        self, blocking: bool = False, no_dist: bool = True, terminate: bool = False
    ) -> list[int]:
        """Finalize finished saves (all of them when ``blocking``); with ``terminate``, then
        close (stop the worker). After a close, with no save since, it does nothing and
        returns ``[]``: terminating twice is harmless."""
        if self._terminated:
            return []
        finalized = self._queue.maybe_finalize_async_calls(blocking=blocking, no_dist=no_dist)
        if terminate:
            self.close()
        return finalized

    def close(self, abort: bool = False) -> list[int]:
        """Finalize pending saves (or drop them with ``abort``) and stop the worker; returns
        the dropped calls. A later save starts a new worker."""
        dropped = self._queue.close(abort=abort)
        self._terminated = True
        return dropped
