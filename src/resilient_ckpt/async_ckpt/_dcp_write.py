"""The write side of the async DCP writer: one data file, its checksum, the types a write uses.

What runs where. The trainer splits a rank's plan into *write buckets*, one per data file
(:mod:`._dcp_buckets`); the background process (persistent worker,
forked child, or the trainer itself for ``execute_sync``) runs
:func:`._dcp_run.run_write_job`, which writes each bucket with :func:`write_file`.

Decisions:

* **Byte-identical files.** Each item is serialised by torch's own item writer (reached
  through :mod:`.._torch_compat`), bytes items first, then tensors in plan order, exactly as
  ``FileSystemWriter`` does with one thread in a process without CUDA (and as NVRx's
  writer does); tensors whose storage is larger than their bytes are compacted first, as
  torch does. Where CUDA is available, torch's one-thread writer orders a file's tensors by
  size instead (its overlapping loader): the same checkpoint, other bytes.
* **Checksums while writing.** A thin stream wrapper feeds every written buffer to the
  fastest installed CRC-32 (:mod:`.._checksum`: ISA-L with the ``fast`` extra, ~3x zlib's
  speed, same values; all release the GIL), so each file's size and CRC32 cost no extra
  pass over the data and no read-back.

Running the lanes of files and the results file: :mod:`._dcp_run`.
"""

from __future__ import annotations

import io
import os
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, BinaryIO, cast

import torch
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from .._checksum import crc32
from .._logging import get_logger
from .._torch_compat import write_item
from ..config import RetryPolicy
from ..storage import PosixBackend, StorageBackend, get_backend
from ..storage.commit import atomic_file
from .cached_metadata_filesystem_reader import ITEM_ALIGNMENT

logger = get_logger(__name__)

BytesData = list[tuple[WriteItem, io.BytesIO]]
TensorData = list[tuple[WriteItem, torch.Tensor]]
# One data file: (its path, its name inside the checkpoint = the DCP storage key, its items).
WriteBucket = tuple[str, str, tuple[BytesData, TensorData]]

RESULTS_SUFFIX = ".write_results"


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

    @property
    def results_name(self) -> str:
        return f"__{self.rank}{RESULTS_SUFFIX}"

    def backend(self) -> StorageBackend:
        return get_backend(self.checkpoint_dir, use_msc=self.use_msc, retry=self.retry)


@dataclass(frozen=True)
class FileRecord:
    """One written data file: its name, size, CRC32 and the DCP results of its items."""

    name: str
    size: int
    crc32: int
    results: list[WriteResult]


@dataclass
class RankWriteReport:
    """Content of a rank's results file."""

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


# -- writing (background) -------------------------------------------------------------------


class ChecksumStream:
    """Write-only stream that tracks the size and CRC32 of everything written through it.

    With ``early_writeback`` (set when the file will be fsynced) it also asks the kernel to
    start writing each full ``WRITEBACK_BYTES`` to disk right away (``posix_fadvise``
    ``DONTNEED`` starts writeback of dirty pages and drops them from the page cache once
    clean). Otherwise nothing reaches the disk before the final fsync (the dirty-page
    thresholds are gigabytes), so serialising and checksumming would not overlap the disk
    at all. Large buffers are handled in slices so the overlap also happens within one
    big tensor.
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
        """Pad with zeros up to a multiple of ``boundary`` bytes. DCP records each item's
        offset and length, so bytes between items are never read; a tensor item that starts
        aligned can be loaded as a view of a mapped file (see
        :mod:`.cached_metadata_filesystem_reader`)."""
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
    with opened as raw:
        stream = ChecksumStream(raw, early_writeback=job.sync_files)
        for item, data in bytes_data:
            results.append(write_item(job.transforms, stream, data, item, name))
        for item, tensor in tensor_data:
            if job.align_items:
                stream.align(ITEM_ALIGNMENT)
            results.append(write_item(job.transforms, stream, compact(tensor), item, name))
        stream.flush()
    return FileRecord(name, stream.size, stream.crc32, results)
