"""The background half of a tiered save: one staged snapshot, written to every tier.

Decision: a save is planned once (DCP planner, cached plan) for a writer pointed at this
rank's memory-tier step directory, and scheduled as *one* ``AsyncRequest`` whose tensors
the persistent worker's queue stages once into its shared-memory arena. The worker then
runs :func:`write_tiers`: the memory-tier files and, on a durable save, the same staged
buckets into the durable step directory, concurrently (the memory write is not delayed by
the slower durable one, nor the durable one by it). So a save that also goes durable
stalls the trainer exactly as long as a memory-only one: the durable write is more
background work, not another snapshot.

Alternatives rejected: a second request for the durable copy would stage the state a
second time (twice the stall and the host memory); copying the memory-tier files to
durable storage later from the trainer process would compete with training for the GIL
and for the page cache.

Each tier's write posts its own report (its job's token is the key; see
``async_ckpt._dcp_write``), sent to the trainer over the worker's channel as soon as that
tier's files are written: the memory tier is committed as soon as its report arrives,
without waiting for the durable write running beside it in the same call. A memory-tier
failure (the RAM tier full) is recorded in its report and never stops the durable write;
if even the report cannot be sent, the failure is logged and the trainer sees "call
finished, no memory report", which it treats as a failed memory write.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import pickle
import threading
import uuid
from typing import Any

from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.stateful import Stateful

from .._logging import get_logger
from ..async_ckpt._dcp_buckets import file_names
from ..async_ckpt._dcp_write import (
    FileRecord,
    WriteBucket,
    WriteJob,
    decode_results,
    run_write_job,
    write_file,
)
from ..async_ckpt.filesystem_async import FILE_TABLE_ATTR, FileSystemWriterAsync
from ..async_ckpt.state_dict_saver import save_state_dict_async_finalize
from ..errors import CheckpointWriteError, ConfigurationError, CorruptCheckpointError
from ..storage import get_backend
from ._layout import step_name
from ._options import TieredOptions

logger = get_logger(__name__)


def write_tiers(
    memory_job: WriteJob | None,
    durable_job: WriteJob | None,
    rank: int,
    buckets: list[WriteBucket],
) -> None:
    """Worker entry point: write ``buckets`` to the memory tier and, at the same time, to
    the durable tier (both read the same staged bytes; neither waits for the other)."""
    if durable_job is None:
        if memory_job is not None:
            _write_memory_tier(memory_job, rank, buckets, durable=False)
        return
    memory_thread: threading.Thread | None = None
    if memory_job is not None:
        memory_thread = threading.Thread(
            target=_write_memory_tier,
            args=(memory_job, rank, buckets),
            kwargs={"durable": True},
            name="resilient_ckpt-memory-tier",
            daemon=True,
        )
        memory_thread.start()
    try:
        backend = durable_job.backend()
        retargeted = [
            (backend.join(durable_job.checkpoint_dir, name), name, items)
            for _, name, items in buckets
        ]
        run_write_job(durable_job, retargeted, functools.partial(write_file, durable_job))
    finally:
        if memory_thread is not None:
            # The arena holding the bytes is reused once this call returns.
            memory_thread.join()


def _write_memory_tier(job: WriteJob, rank: int, buckets: list[WriteBucket], durable: bool) -> None:
    try:
        run_write_job(job, buckets, functools.partial(write_file, job))
    except Exception as exc:
        # Could not even send the outcome. Without a durable copy to write, fail the call:
        # its error then reaches every rank. Otherwise the durable copy is written anyway;
        # the trainer notices the missing report once this call ends.
        if not durable:
            raise
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        logger.error("memory tier write of rank %d left no report: %s", rank, first_line)


class DurableCopyWriter(FileSystemWriterAsync):
    """The durable tier's writer: it writes the buckets planned for the memory tier.

    It is never planned itself: :meth:`adopt` takes the memory writer's buckets (the same
    file names, the same items) and makes its own job for the durable directory, so
    ``retrieve_write_results`` and ``finish`` (the DCP commit) work as for any async save.
    """

    setup_error: Exception | None = None

    def adopt(self, memory_job: WriteJob | None, buckets: list[WriteBucket]) -> None:
        """Take the memory writer's planned files (names only: the payload stays with the
        request) and make this tier's job from the memory job."""
        self._payload = None
        self._expected_files = file_names(buckets)
        self._job = None
        if memory_job is not None:
            self._job = dataclasses.replace(
                memory_job,
                checkpoint_dir=self.checkpoint_dir,
                use_msc=self.use_msc,
                token=uuid.uuid4().hex,
                sync_files=self.sync_files,
                retry=self.retry_policy,
            )
        self.written_files = {}

    @property
    def job(self) -> WriteJob | None:
        return None if self.setup_error is not None else self._job

    def retrieve_write_rows(self) -> list[bytes]:
        if self.setup_error is not None:
            raise CheckpointWriteError(
                f"rank {self._rank()}: could not prepare {self.checkpoint_dir!r}: "
                f"{self.setup_error!r}",
                rank=self._rank(),
                path=str(self.checkpoint_dir),
            ) from self.setup_error
        return super().retrieve_write_rows()


def split_save_function(writer: FileSystemWriterAsync) -> tuple[WriteJob | None, Any, list]:
    """``(memory job, preload_fn, args)`` of a prepared writer (job None: nothing to write).

    Calls ``get_save_function_and_args`` once: the writer hands its payload over.
    """
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    if save_fn is None:
        return None, None, list(args)
    job = save_fn.args[0]
    return (job if isinstance(job, WriteJob) else None), preload_fn, list(args)


def durable_job_of(writer: DurableCopyWriter) -> WriteJob | None:
    return writer.job


def commit_metadata_bytes(
    metadata: Metadata, reports: list[list[FileRecord]], storage_meta: Any
) -> bytes:
    """The memory tier's commit record: the global metadata with every rank's storage
    locations and the size/CRC32 table of every data file (as the async writer records)."""
    md = copy.copy(metadata)
    md.storage_data = {
        result.index: result.storage_data
        for records in reports
        for record in records
        for result in decode_results(record.results)
    }
    md.storage_meta = storage_meta
    table = {record.name: (record.size, record.crc32) for records in reports for record in records}
    setattr(md, FILE_TABLE_ATTR, {"algorithm": "crc32", "files": table})
    return pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL)


def file_table(metadata: Any, path: str = "the commit record") -> dict[str, tuple[int, int]]:
    """The size and CRC-32 of every data file, from a commit record (empty: it has none,
    as a record not written by this package). A table of another shape is a
    ``CorruptCheckpointError`` naming ``path``."""
    table = getattr(metadata, FILE_TABLE_ATTR, None) or {}
    try:
        return {name: (int(s), int(c)) for name, (s, c) in dict(table.get("files", {})).items()}
    except (AttributeError, TypeError, ValueError) as exc:
        raise CorruptCheckpointError(
            f"{path}: malformed file table ({type(exc).__name__}: {exc})", path=path
        ) from exc


def plain_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Top-level ``Stateful`` values replaced by their state dicts (as ``dcp.save`` does)."""
    if not isinstance(state_dict, dict):
        raise ConfigurationError(
            f"state_dict must be a dict (what dcp.save takes), got {type(state_dict).__name__}"
        )
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}


def writer_options(options: TieredOptions) -> dict[str, Any]:
    """The memory tier writer's options: its saves and their warm-up plan alike with them."""
    return {"single_file_per_rank": True, "sync_files": False, "thread_count": options.thread_count}


def open_memory_writer(step_dir: str, options: TieredOptions) -> FileSystemWriterAsync:
    """The writer a save is planned for: this rank's memory-tier step directory."""
    writer = FileSystemWriterAsync(step_dir, **writer_options(options))
    writer.align_items = True  # restores copy each tensor once, from the mapped file
    return writer


def open_durable_writer(
    durable_dir: str, step: int, rank: int, options: TieredOptions
) -> DurableCopyWriter:
    """Set up the durable step directory, before planning (no collective of its own).

    The coordinator removes a stale ``.metadata`` of this step first, and planning's
    collective that follows orders that before any rank's worker writes data files. A
    set-up failure is kept, not raised: raising on one rank here would leave the others
    in the planning collective; it fails the durable commit on every rank instead.
    """
    path = get_backend(durable_dir).join(durable_dir, step_name(step))
    writer = DurableCopyWriter(
        path, **{**writer_options(options), "sync_files": options.durable_sync}
    )
    try:
        writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
    except Exception as exc:
        logger.error("cannot prepare durable step %d in %s: %r", step, path, exc)
        writer.setup_error = exc
    return writer


def commit_durable(writer: DurableCopyWriter, metadata: Any, dist_wrapper: Any, step: int) -> None:
    """Finalize the durable DCP save of ``step`` (its ``.metadata`` last); a failure on any
    rank is a ``CheckpointWriteError`` on every rank and nothing is committed."""
    try:
        save_state_dict_async_finalize(writer, metadata, dist_wrapper)
    except CheckpointException as exc:
        raise CheckpointWriteError(
            f"tiered save of step {step}: the durable write to {writer.checkpoint_dir!r} "
            f"failed, not committed: {exc}",
            path=str(writer.checkpoint_dir),
        ) from exc
