"""The background side of the async DCP writer: a rank's data files written in lanes, each
file checksummed, the outcome reported to the trainer.

The trainer builds one write bucket per data file (:mod:`._dcp_buckets`); the background
process (persistent worker, forked child, or the trainer itself for ``execute_sync``) runs
:func:`run_write_job`, which writes each bucket with :func:`write_file` and posts a
:class:`RankWriteReport` that the trainer takes (:func:`take_report`).

* **Byte-identical files.** Items are serialised by torch's own item writer (through
  :mod:`.._torch_compat`), bytes items first, then tensors in plan order, exactly as
  ``FileSystemWriter`` does with one thread and no CUDA (and as NVRx's writer does); tensors
  whose storage is larger than their bytes are compacted first, as torch does. With CUDA,
  torch's writer orders tensors by size instead: the same checkpoint, other bytes.
* **Checksums while writing**: a stream wrapper feeds every buffer to the CRC-32 of
  :mod:`.._checksum`, so size and CRC32 cost no extra pass and no read-back.
* **Lanes of files, all started first.** Files are dealt to ``thread_count`` lanes balanced
  by bytes; every extra lane starts before the calling thread writes its own, so lanes really
  overlap (``torch.save`` and ``write`` release the GIL). With ``multiproc_io`` the extra
  lanes are forked processes.
* **The outcome is a report, not a file** (:mod:`._reports` says why), keyed by the job's
  token so a report of another save cannot be taken for this one. It is sent as soon as the
  files are written, before the call ends (the tiered manager's memory tier uses it early).
  Written in the trainer itself, the report goes into the job's own :class:`._reports.Reports`;
  from a background process, into its call's, on the caller that ran it. A
  write failure is recorded in the report rather than raised, so finalize still runs on
  every rank and reports it everywhere.
"""

from __future__ import annotations

import heapq
import io
import multiprocessing as mp
import os
import pickle
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, BinaryIO, cast

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from .. import _telemetry
from .._checksum import crc32
from .._logging import get_logger
from .._torch_compat import storage_info, write_item
from ..config import RetryPolicy
from ..errors import CheckpointWriteError
from ..storage import PosixBackend, StorageBackend, get_backend
from ..storage.commit import atomic_file
from . import _reports
from ._dcp_items import ITEM_ALIGNMENT
from ._worker import arm_parent_death_signal

logger = get_logger(__name__)

BytesData = list[tuple[WriteItem, io.BytesIO]]
TensorData = list[tuple[WriteItem, torch.Tensor]]
# One data file: (its path, its name inside the checkpoint = the DCP storage key, its items).
WriteBucket = tuple[str, str, tuple[BytesData, TensorData]]


@dataclass(frozen=True)
class WriteJob:
    """Everything the background write needs besides the buckets (small, picklable)."""

    checkpoint_dir: str
    use_msc: bool
    rank: int
    token: str
    sync_files: bool
    thread_count: int
    transforms: Any = None
    retry: RetryPolicy | None = None
    # NVRx's writer hooks: the function opening each data file (None: the built-in open,
    # through the backend) and writing with child processes instead of threads.
    open_file: Any = None
    multiproc_io: bool = False
    # Start each tensor item on a 64-byte boundary so a mapped file's tensors load as views
    # (``read_items`` of the readers' module); off by default, so files stay byte-identical
    # to torch's writer.
    align_items: bool = False
    # Where the report lands when the job runs in the trainer (it arrives empty elsewhere).
    reports: _reports.Reports = field(default_factory=_reports.Reports, compare=False, repr=False)

    def backend(self) -> StorageBackend:
        return get_backend(self.checkpoint_dir, use_msc=self.use_msc, retry=self.retry)


@dataclass(frozen=True)
class FileRecord:
    """One written data file: its name, size, CRC32 and the DCP results of its items, as
    :func:`encode_results` wrote them (decoded where a ``WriteResult`` is needed)."""

    name: str
    size: int
    crc32: int
    results: bytes


# -- the write results, compact ----------------------------------------------------------------
#
# A file's results cross the worker's channel, and then the finalize's gather, as one bytes
# object: rows of plain values, pickled by the worker. Pickling a ``WriteResult`` costs a
# Python call for each of its objects, and thousands of them crossed two process boundaries
# per save, to be used on one rank: the coordinator, which decodes each distinct bytes once
# (:func:`decode_results`) and, in steady state, not at all.
_ROWS, _OBJECTS = 0, 1


def encode_results(results: Sequence[WriteResult]) -> bytes:
    """``results`` as rows ``(fqn, offset, index, size, path, offset, length, transforms)``;
    results whose storage data is not DCP's file location travel as objects."""
    rows = []
    for r in results:
        info = r.storage_data
        try:
            where = (info.relative_path, info.offset, info.length, info.transform_descriptors)
        except AttributeError:
            return pickle.dumps((_OBJECTS, list(results)), protocol=pickle.HIGHEST_PROTOCOL)
        offset = None if r.index.offset is None else tuple(r.index.offset)
        rows.append((r.index.fqn, offset, r.index.index, r.size_in_bytes, *where))
    return pickle.dumps((_ROWS, rows), protocol=pickle.HIGHEST_PROTOCOL)


def _decode(encoded: bytes) -> tuple[WriteResult, ...]:
    kind, body = pickle.loads(encoded)
    if kind == _OBJECTS:
        return tuple(body)
    offsets: dict[tuple, torch.Size] = {}  # equal offsets one object: see share_equal_sizes
    results = []
    for fqn, offset, index, size, path, at, length, transforms in body:
        key = MetadataIndex(fqn, None, index)
        if offset is not None:
            object.__setattr__(key, "offset", offsets.setdefault(offset, torch.Size(offset)))
        storage = storage_info(path, at, length, transforms or ())
        results.append(WriteResult(index=key, size_in_bytes=size, storage_data=storage))
    return tuple(results)


_decoded: OrderedDict[bytes, tuple[WriteResult, ...]] = OrderedDict()
_decoded_lock = threading.Lock()
# Distinct encodings kept decoded: a steady save's files, on every rank of a large job.
_DECODED_KEPT = 1024


def decode_results(encoded: bytes) -> tuple[WriteResult, ...]:
    """The ``WriteResult`` objects of one file, decoded once per distinct encoding: a save
    laid out as the last one finds its results decoded (they are immutable)."""
    with _decoded_lock:
        found = _decoded.get(encoded)
        if found is not None:
            _decoded.move_to_end(encoded)
            return found
    results = _decode(encoded)
    with _decoded_lock:
        _decoded[encoded] = results
        while len(_decoded) > _DECODED_KEPT:
            _decoded.popitem(last=False)
    return results


@dataclass
class RankWriteReport:
    """What a rank's background write reports to the trainer."""

    token: str
    rank: int
    files: list[FileRecord] = field(default_factory=list)
    failure: str | None = None
    seconds: float = 0.0


# -- sizes (both sides) ----------------------------------------------------------------------


def bucket_nbytes(bucket: WriteBucket) -> int:
    _, _, (bytes_data, tensor_data) = bucket
    total = sum(data.getbuffer().nbytes for _, data in bytes_data)
    return total + sum(t.numel() * t.element_size() for _, t in tensor_data)


def compact(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor whose storage holds exactly its bytes (what torch's writer serialises)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


# -- one file -------------------------------------------------------------------------------


class ChecksumStream:
    """Write-only stream that tracks the size and CRC32 of everything written through it.

    With ``early_writeback`` (the file will be fsynced) each full ``WRITEBACK_BYTES`` is handed
    to the kernel for writeback at once (``posix_fadvise`` ``DONTNEED``): otherwise nothing
    reaches the disk before the final fsync (the dirty-page thresholds are large),
    so serialising would not overlap the disk. Large buffers go in slices so the overlap
    also happens within one tensor.
    """

    SLICE_BYTES = 16 << 20
    WRITEBACK_BYTES = 32 << 20

    def __init__(self, raw: BinaryIO, *, early_writeback: bool = False) -> None:
        self._raw = raw
        self.size = 0
        self.crc32 = 0
        self._fd: int | None = None
        self._written_back = 0
        if early_writeback and hasattr(os, "posix_fadvise"):
            try:
                self._fd = raw.fileno()
            except (AttributeError, OSError, io.UnsupportedOperation):
                self._fd = None

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if not view.contiguous:
            view = memoryview(view.tobytes())
        view = view.cast("B")
        for start in range(0, view.nbytes, self.SLICE_BYTES):
            piece = view[start : start + self.SLICE_BYTES]
            self.crc32 = crc32(piece, self.crc32)
            self._raw.write(piece)
            self.size += piece.nbytes
            if self._fd is not None and self.size - self._written_back >= self.WRITEBACK_BYTES:
                self._start_writeback(self._fd)
        return view.nbytes

    def _start_writeback(self, fd: int) -> None:
        self._raw.flush()
        length = self.size - self._written_back
        os.posix_fadvise(fd, self._written_back, length, os.POSIX_FADV_DONTNEED)
        self._written_back = self.size

    def tell(self) -> int:
        return self.size

    def align(self, boundary: int) -> None:
        """Pad with zeros to a multiple of ``boundary``. DCP records each item's offset and
        length, so padding is never read, and an aligned tensor item can be loaded as a view of a
        mapped file.
        """
        if self.size % boundary:
            self.write(bytes(boundary - self.size % boundary))

    def flush(self) -> None:
        self._raw.flush()

    def writable(self) -> bool:
        return True


def write_file(job: WriteJob, bucket: WriteBucket) -> FileRecord:
    """Write one data file atomically (fsynced when ``job.sync_files``); checksum it."""
    path, name, (bytes_data, tensor_data) = bucket
    backend = job.backend()
    results: list[WriteResult] = []
    opened: AbstractContextManager[Any]  # a BinaryIO either way
    if job.open_file is not None and isinstance(backend, PosixBackend):
        opened = cast(
            AbstractContextManager[Any],
            atomic_file(path, sync=job.sync_files, opener=job.open_file),
        )
    else:
        opened = backend.open_write(path, sync=job.sync_files)
    with _telemetry.file_span(name, job.sync_files, job.checkpoint_dir) as span, opened as raw:
        stream = ChecksumStream(raw, early_writeback=job.sync_files)
        for item, data in bytes_data:
            results.append(write_item(job.transforms, stream, data, item, name))
        for item, tensor in tensor_data:
            if job.align_items:
                stream.align(ITEM_ALIGNMENT)
            results.append(write_item(job.transforms, stream, compact(tensor), item, name))
        stream.flush()
        if span is not None:
            span.set_attributes(
                {_telemetry.BYTES: stream.size, "resilient_ckpt.crc32": stream.crc32}
            )
    return FileRecord(name, stream.size, stream.crc32, encode_results(results))


# -- the lanes and the report ----------------------------------------------------------------


def assign_lanes(buckets: Sequence[WriteBucket], lanes: int) -> list[list[WriteBucket]]:
    """Deal files to at most ``lanes`` threads, balanced by bytes (largest first)."""
    if len(buckets) <= lanes:
        return [[b] for b in buckets]
    assigned: list[list[WriteBucket]] = [[] for _ in range(lanes)]
    heap = [(0, k) for k in range(lanes)]
    for bucket in sorted(buckets, key=bucket_nbytes, reverse=True):
        load, k = heapq.heappop(heap)
        assigned[k].append(bucket)
        heapq.heappush(heap, (load + bucket_nbytes(bucket), k))
    return [lane for lane in assigned if lane]


def _run_lane(
    write_one: Callable[[WriteBucket], FileRecord],
    lane: list[WriteBucket],
    outcomes: list[Any],
    index: int,
) -> None:
    try:
        outcomes[index] = [write_one(bucket) for bucket in lane]
    except BaseException as exc:
        outcomes[index] = exc


MULTIPROC_DAEMON_ERROR = (
    "Invalid Setup! is_multiproc_io=True writes the data files with child processes, which "
    "a daemon background worker cannot start: create the AsyncCallsQueue with "
    "is_daemon=False, or leave is_multiproc_io=False (writer threads)"
)


def _lane_process(
    conn: Any, parent_pid: int, write_one: Callable[[WriteBucket], FileRecord], lane: list
) -> None:
    """One forked writer process: write its files, send the records or the failure's text, exit
    without the parent's exit handlers.
    """
    arm_parent_death_signal(parent_pid)
    try:
        try:
            conn.send([write_one(bucket) for bucket in lane])
        except BaseException as exc:
            conn.send("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    finally:
        os._exit(0)


def _write_lanes_in_processes(
    lanes: list[list[WriteBucket]], write_one: Callable[[WriteBucket], FileRecord]
) -> list[Any]:
    """One forked process per lane; each lane's records or exception, in order. The fork shares
    the staged tensors copy-on-write, so nothing is copied to hand them over.
    """
    if mp.current_process().daemon:
        raise CheckpointWriteError(MULTIPROC_DAEMON_ERROR)
    ctx = mp.get_context("fork")
    children = []
    for k, lane in enumerate(lanes):
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_lane_process,
            args=(writer, os.getpid(), write_one, lane),
            name=f"resilient_ckpt-dcp-writer-proc-{k}",
        )
        proc.start()
        writer.close()
        children.append((proc, reader))
    outcomes: list[Any] = []
    for proc, reader in children:
        try:
            outcome = reader.recv()
        except (EOFError, OSError):
            outcome = None
        reader.close()
        proc.join()
        if isinstance(outcome, str):
            outcome = CheckpointWriteError(f"writer process pid {proc.pid} failed:\n{outcome}")
        elif not isinstance(outcome, list):
            outcome = CheckpointWriteError(
                f"writer process pid {proc.pid} ended (exit code {proc.exitcode}) without "
                "reporting its files"
            )
        outcomes.append(outcome)
    return outcomes


def write_all(
    buckets: Sequence[WriteBucket],
    thread_count: int,
    write_one: Callable[[WriteBucket], FileRecord],
    *,
    processes: bool = False,
) -> list[FileRecord]:
    """Write every bucket with up to ``thread_count`` threads (or forked ``processes``); raise the
    first failure.
    """
    lanes = assign_lanes(buckets, max(1, thread_count))
    if processes:
        return _first_failure_or_records(_write_lanes_in_processes(lanes, write_one))
    outcomes: list[Any] = [None] * len(lanes)
    threads = [
        threading.Thread(
            target=_run_lane,
            args=(write_one, lane, outcomes, k),
            name=f"resilient_ckpt-dcp-writer-{k}",
            daemon=True,
        )
        for k, lane in enumerate(lanes)
        if k > 0
    ]
    for thread in threads:
        thread.start()
    if lanes:
        _run_lane(write_one, lanes[0], outcomes, 0)
    for thread in threads:
        thread.join()
    return _first_failure_or_records(outcomes)


def _first_failure_or_records(outcomes: list[Any]) -> list[FileRecord]:
    failures = [o for o in outcomes if isinstance(o, BaseException)]
    if failures:
        for extra in failures[1:]:
            logger.error("another writer thread failed too: %r", extra)
        raise failures[0]
    return [record for lane_records in outcomes for record in lane_records]


def run_write_job(
    job: WriteJob,
    buckets: Sequence[WriteBucket],
    write_one: Callable[[WriteBucket], FileRecord],
) -> None:
    """Write this rank's files, then post the outcome for the trainer (under the token)."""
    started = time.perf_counter()
    report = RankWriteReport(job.token, job.rank)
    try:
        report.files = write_all(buckets, job.thread_count, write_one, processes=job.multiproc_io)
    except Exception as exc:
        report.failure = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        logger.error("writing checkpoint files in %s failed: %r", job.checkpoint_dir, exc)
    report.seconds = time.perf_counter() - started
    try:
        _reports.post(job.reports, job.token, report)
    except Exception as exc:
        raise CheckpointWriteError(
            f"rank {job.rank}: could not send the write results of {job.checkpoint_dir!r} "
            f"to the trainer ({exc!r}); write outcome: {report.failure or 'success'}",
            rank=job.rank,
            path=job.checkpoint_dir,
        ) from exc
    if report.failure is None:
        nbytes = sum(f.size for f in report.files)
        logger.info(
            "wrote %d file(s), %d bytes in %.3fs (%.1f MB/s)",
            len(report.files),
            nbytes,
            report.seconds,
            nbytes / max(report.seconds, 1e-9) / 1e6,
        )


def take_report(
    job: WriteJob, *, reports: _reports.Reports | None = None, timeout: float = 0.0
) -> RankWriteReport:
    """This rank's write report (trainer side): the one the job got in the trainer, else the
    one in ``reports`` (its call's; default: the call being finalized), waiting up to
    ``timeout`` while the call runs; named errors when it did not report.
    """
    what = f"the background write to {job.checkpoint_dir!r}"
    report = _reports.take(
        job.token, rank=job.rank, what=what, local=job.reports, call=reports, timeout=timeout
    )
    if not isinstance(report, RankWriteReport) or report.token != job.token:
        raise CheckpointWriteError(
            f"rank {job.rank}: {what} reported {type(report).__name__}, not this save's "
            "write results",
            rank=job.rank,
            path=job.checkpoint_dir,
        )
    return report
