"""``async_save`` and ``save``: torch's ``dcp.async_save`` and ``dcp.save`` on our engine.

What a call does (every rank, in the same order, as with torch): commit the earlier saves
that are done on every rank (one non-blocking agreement of the queue), plan the save with
the plan cache (:func:`~resilient_ckpt.async_ckpt.state_dict_saver.save_state_dict_async_plan`,
``enable_cache=True``: a steady save of an unchanged structure pays one small collective,
not DCP's planning), snapshot the state into the persistent worker's reusable shared-memory
arenas and return. The worker writes the files with their CRC-32s; the commit
(:func:`~resilient_ckpt.async_ckpt.state_dict_saver.save_state_dict_async_finalize`: every
rank's outcome gathered, ``.metadata`` written last by the coordinator) runs in the trainer.

Decision: when the commit runs. torch runs the whole save, its collectives included, in a
thread or a daemon process and completes the future from there. Our commit is collective on
the trainer's side (the queue's agreement on the library's gloo group, then the caller's
group): run from a thread of ours it could interleave with the trainer's own collectives,
or with the next save's, in a different order on different ranks. So it runs at points that
every rank reaches in the same order: the next ``async_save`` (non-blocking: a save not done
everywhere stays pending), the returned future's ``result()`` (blocking; every rank must
call it, as torchtitan and Lightning do), and :func:`close`. A future is therefore ``done()``
only after one of those; it never completes behind the trainer's back. A failure on any
rank (a write, the commit, a worker that died) is set on that save's future on every rank,
and ``result()`` raises it there (a ``RankFailureError``, also torch's
``CheckpointException``); nothing is committed.

Decision: the return type follows torch's rule for the same arguments: an
``AsyncSaveResponse`` when the stager passed would stage in the background (torch's
``DefaultStager`` with ``use_async_staging``, ``Stager(async_staging=True)``), else a
``Future``. The stager itself is not called: the engine stages into its own arenas. A
background-staging stager maps onto the engine's overlapped staging (the call returns before
the copy; ``staging_completion.result()`` waits for it), without one the call returns once
the snapshot is taken. A stager whose staging means something else (torch's replication
stager, a user's own) cannot be honoured and is refused, naming it.

The future's value: the checkpoint's ``Metadata`` on the coordinator rank, None on the
others (torch broadcasts the metadata to every rank; at thousands of tensors that is a
large object per save that torchtitan and Lightning never read).
"""

from __future__ import annotations

import copy
import functools
import os
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, cast

import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.staging import AsyncStager, BlockingAsyncStager, DefaultStager
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import StorageWriter

from .._logging import get_logger
from .._torch_compat import default_stager_is_async
from ..async_ckpt.core import AsyncCallsQueue, AsyncRequest
from ..async_ckpt.filesystem_async import FileSystemWriterAsync
from ..async_ckpt.state_dict_saver import (
    CheckpointMetadataCache,
    planned_metadata,
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from ..errors import ConfigurationError
from ._stager import Stager
from ._writer import FileSystemWriter

logger = get_logger(__name__)

__all__ = ["async_save", "close", "save"]

# What a failed save raises: ours are Exceptions; torch's CheckpointException is not.
_SAVE_ERRORS = (Exception, CheckpointException)


class _Engine:
    """This process's queue (one persistent worker), plan cache and pending saves, oldest
    first. Used from the trainer's thread only (see the module note)."""

    def __init__(self) -> None:
        self.queue = AsyncCallsQueue()
        self.cache = CheckpointMetadataCache()
        self.pending: deque[_SaveFuture] = deque()
        self.no_dist = False

    def commit_done(self, blocking: bool) -> None:
        """Commit the saves done on every rank (all of them when ``blocking``); a failure is
        set on the save it belongs to, never raised here."""
        while self.pending:
            try:
                self.queue.maybe_finalize_async_calls(blocking=blocking, no_dist=self.no_dist)
            except _SAVE_ERRORS as exc:
                self._fail_oldest(exc)
                continue
            self._drop_done()
            return

    def _fail_oldest(self, exc: BaseException) -> None:
        """The queue finalizes oldest first: the failed save is the oldest not committed."""
        self._drop_done()
        if self.pending:
            self.pending.popleft().set_exception(exc)

    def _drop_done(self) -> None:
        while self.pending and self.pending[0].done():
            self.pending.popleft()


_engine: _Engine | None = None
_engine_lock = threading.Lock()


def _get_engine() -> _Engine:
    global _engine
    with _engine_lock:
        if _engine is None:
            _engine = _Engine()
        return _engine


class _SaveFuture(Future):
    """A save's completion: set when the save is committed (or failed) on every rank.
    ``result()`` and ``exception()`` commit what is pending first (collective: every rank
    calls them, in the same order as its saves); that wait is bounded by the engine's
    finalize deadline (``RESILIENT_CKPT_FINALIZE_TIMEOUT``), not by ``timeout``, which a
    rank alone cannot apply to a collective."""

    def __init__(self, engine: _Engine) -> None:
        super().__init__()
        self._engine = engine

    def result(self, timeout: float | None = None) -> Any:
        self._settle()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._settle()
        return super().exception(timeout)

    def _settle(self) -> None:
        if not self.done():
            self._engine.commit_done(blocking=True)


class _StagedFuture(Future):
    """``staging_completion`` of an overlapped save: ``result()`` waits for the snapshot
    (local to this rank); after it, the saved tensors may change."""

    def __init__(self, queue: AsyncCallsQueue) -> None:
        super().__init__()
        self._queue = queue

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            try:
                self._queue.wait_for_snapshot(timeout)
            except _SAVE_ERRORS as exc:
                self.set_exception(exc)
            else:
                self.set_result(None)
        return super().result(timeout)


def _commit(plan: tuple, future: _SaveFuture) -> None:
    """The save's finalize function (trainer, every rank): commit, then complete its future.
    A failure propagates to the queue's caller, :meth:`_Engine.commit_done`, which sets it
    on this future."""
    save_state_dict_async_finalize(*plan)
    future.set_result(planned_metadata(plan[1]))


# -- the arguments -----------------------------------------------------------------------------


def _stages_in_background(async_stager: Any) -> bool:
    """Whether torch would answer an ``AsyncSaveResponse`` for this stager; refuses the
    stagers the engine cannot stand in for."""
    if async_stager is None or isinstance(async_stager, BlockingAsyncStager):
        return False
    if isinstance(async_stager, Stager):
        return async_stager.async_staging
    if isinstance(async_stager, DefaultStager):
        return default_stager_is_async(async_stager)
    kind = type(async_stager).__name__
    if isinstance(async_stager, AsyncStager):
        raise ConfigurationError(
            f"resilient_ckpt.dcp.async_save(async_stager=<{kind}>): this stager's staging "
            "cannot be honoured (the engine snapshots into its own shared memory); pass None, "
            "resilient_ckpt.dcp.Stager, torch's DefaultStager or BlockingAsyncStager, or save "
            "with torch.distributed.checkpoint.async_save to use this stager"
        )
    raise ConfigurationError(
        f"resilient_ckpt.dcp.async_save(async_stager=...) must be an AsyncStager or None, "
        f"got {kind}"
    )


def _writer_for(checkpoint_id: Any, storage_writer: StorageWriter | None) -> Any:
    """A writer of the engine's kind holding this save only (a copy of the caller's, which
    may be passed again while this save is pending)."""
    if storage_writer is None:
        if checkpoint_id is None:
            raise ConfigurationError(
                "resilient_ckpt.dcp.async_save: pass checkpoint_id (the checkpoint directory) "
                "or storage_writer"
            )
        return FileSystemWriter(checkpoint_id)
    if not isinstance(storage_writer, FileSystemWriterAsync):
        raise ConfigurationError(
            f"resilient_ckpt.dcp.async_save(storage_writer=<{type(storage_writer).__name__}>): "
            "the engine writes through resilient_ckpt.dcp.FileSystemWriter (or "
            "FileSystemWriterAsync); pass one of those, or only checkpoint_id, or save with "
            "torch.distributed.checkpoint.async_save to use this writer"
        )
    writer = copy.copy(storage_writer)
    if checkpoint_id is not None:
        writer.reset(checkpoint_id)
    return writer


def _check_distribution(process_group: Any, no_dist: bool, use_collectives: bool) -> bool:
    """Whether the save runs without collectives; refuses what the engine cannot do."""
    if not use_collectives:
        raise ConfigurationError(
            "resilient_ckpt.dcp.async_save(use_collectives=False) is not supported: the "
            "engine's commit agrees across ranks; drop the argument"
        )
    initialized = dist.is_available() and dist.is_initialized()
    if no_dist and initialized:
        raise ConfigurationError(
            "resilient_ckpt.dcp.async_save(no_dist=True) with an initialized process group is "
            "not supported (the plan cache and the commit agree across all ranks); call it "
            "on every rank without no_dist, or before init_process_group"
        )
    if process_group is not None and initialized:
        size = dist.get_world_size(process_group)
        if size != dist.get_world_size():
            raise ConfigurationError(
                f"resilient_ckpt.dcp.async_save(process_group=...) spans {size} of "
                f"{dist.get_world_size()} ranks; the engine's agreement spans every rank, so "
                "the group must too (pass None or a group of all ranks, e.g. a gloo one)"
            )
    return not initialized


def _check_checkpointer_type(async_checkpointer_type: Any) -> None:
    if async_checkpointer_type is None or isinstance(
        async_checkpointer_type, AsyncCheckpointerType
    ):
        return
    raise ConfigurationError(
        "resilient_ckpt.dcp.async_save(async_checkpointer_type=...) must be an "
        f"AsyncCheckpointerType or None, got {async_checkpointer_type!r}"
    )


def _to_state_dict(state_dict: STATE_DICT_TYPE) -> STATE_DICT_TYPE:
    """Stateful values replaced by their ``state_dict()``, as torch's saves do."""
    if not isinstance(state_dict, dict):
        raise ConfigurationError(
            f"resilient_ckpt.dcp.async_save: state_dict must be a dict, got "
            f"{type(state_dict).__name__}"
        )
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}


# -- the calls -----------------------------------------------------------------------------------


def async_save(
    state_dict: STATE_DICT_TYPE,
    *,
    checkpoint_id: str | os.PathLike | None = None,
    storage_writer: StorageWriter | None = None,
    planner: SavePlanner | None = None,
    process_group: dist.ProcessGroup | None = None,
    async_checkpointer_type: AsyncCheckpointerType | None = AsyncCheckpointerType.THREAD,
    async_stager: AsyncStager | None = None,
    no_dist: bool = False,
    use_collectives: bool = True,
) -> Future | AsyncSaveResponse:
    """torch's ``dcp.async_save``, on this package's engine (see the module note).

    Every rank calls it, in the same order. Returns once the state is snapshotted (or, with
    a background-staging ``async_stager``, at once, answering an ``AsyncSaveResponse`` whose
    ``staging_completion`` waits for the snapshot). The future (``upload_completion``)
    completes when the save is committed on every rank: at a later ``async_save``, at its
    ``result()`` (every rank calls it) or at :func:`close`.

    Args:
        state_dict: what to save (tensors, DTensors, ``Stateful`` values, picklable objects).
        checkpoint_id: the checkpoint directory (or ``msc://`` URL).
        storage_writer: a :class:`~resilient_ckpt.dcp.FileSystemWriter` (or
            ``FileSystemWriterAsync``) whose options to write with; it is copied, so one
            writer may serve many saves. Other writers are refused.
        planner: a ``SavePlanner`` (default: torch's ``DefaultSavePlanner``).
        process_group: the group to plan and commit on (all ranks; default: the world).
        async_checkpointer_type: accepted for torch's signature; the write always runs in
            this rank's persistent worker process, whichever is passed.
        async_stager: chooses the return type and overlapped staging (module note).
        no_dist: save on this process only; needs no initialized process group.
        use_collectives: must be True.
    """
    _check_checkpointer_type(async_checkpointer_type)
    local = _check_distribution(process_group, no_dist, use_collectives)
    overlap = _stages_in_background(async_stager)
    state = _to_state_dict(state_dict)
    writer = _writer_for(checkpoint_id, storage_writer)
    engine = _get_engine()
    engine.no_dist = local
    engine.commit_done(blocking=False)
    plan = save_state_dict_async_plan(
        state,
        writer,
        process_group,
        planner=planner,
        enable_cache=True,
        metadata_cache=engine.cache,
        defer_planning=overlap and process_group is None,
    )
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    future = _SaveFuture(engine)
    request = AsyncRequest(
        save_fn, args, [functools.partial(_commit, plan, future)], preload_fn=preload_fn
    )
    engine.queue.schedule_async_request(request, overlap_staging=overlap)
    engine.pending.append(future)
    if not overlap:
        return future
    return AsyncSaveResponse(
        staging_completion=_StagedFuture(engine.queue), upload_completion=future
    )


def save(
    state_dict: STATE_DICT_TYPE,
    *,
    checkpoint_id: str | os.PathLike | None = None,
    storage_writer: StorageWriter | None = None,
    planner: SavePlanner | None = None,
    process_group: dist.ProcessGroup | None = None,
    no_dist: bool = False,
    use_collectives: bool = True,
) -> Metadata | None:
    """torch's ``dcp.save`` on this package's engine: :func:`async_save`, then its commit
    (every rank). Returns the checkpoint's ``Metadata`` on the coordinator, None elsewhere."""
    future = async_save(
        state_dict,
        checkpoint_id=checkpoint_id,
        storage_writer=storage_writer,
        planner=planner,
        process_group=process_group,
        no_dist=no_dist,
        use_collectives=use_collectives,
    )
    return cast(Future, future).result()  # without a stager, async_save returns a Future


def close(abort: bool = False) -> None:
    """Commit every pending save (collective; ``abort=True``: drop them, nothing
    committed) and stop this process's worker. Safe to call twice; a later ``async_save``
    starts a new worker."""
    global _engine
    with _engine_lock:
        engine, _engine = _engine, None
    if engine is None:
        return
    try:
        if not abort:
            engine.commit_done(blocking=True)
    finally:
        engine.queue.close(abort=True)
        for future in engine.pending:
            if not future.done():
                future.set_exception(
                    ConfigurationError("resilient_ckpt.dcp.close(abort=True) dropped this save")
                )
