"""Verify a committed DCP checkpoint: every data file present, of the right size, intact.

The commit record written by :class:`FileSystemWriterAsync` carries every data file's size
and CRC32, recorded while the files were written; :func:`verify_checkpoint` re-reads each
file and compares. For other DCP writers' checkpoints (no table) it checks what the metadata
implies: each file exists and is long enough for its last item. The metadata is read with
the restricted unpickler (:mod:`resilient_ckpt._restricted_pickle`), so verifying a
checkpoint from elsewhere never runs its code. All reads go through the storage backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from .. import _restricted_pickle
from .._checksum import crc32
from ..errors import CorruptCheckpointError, StorageError
from ..storage import StorageBackend, get_backend
from ..storage.commit import RecordCommit
from .filesystem_async import FILE_TABLE_ATTR

__all__ = ["VerifiedCheckpoint", "size_problems", "verify_checkpoint"]

_CHUNK = 8 << 20


@dataclass
class VerifiedCheckpoint:
    """Outcome of a successful verification."""

    path: str
    files: dict[str, int] = field(default_factory=dict)
    checksummed: bool = False

    @property
    def nbytes(self) -> int:
        return sum(self.files.values())


def _load_metadata(backend: StorageBackend, path: str, trusted: bool = False) -> Any:
    record = RecordCommit(backend, path)
    commit = record.record_path
    if not record.is_committed():
        raise CorruptCheckpointError(
            f"{path!r} is not a committed checkpoint: {record.record} is missing", path=path
        )
    try:
        with backend.open_read(commit) as f:
            return _restricted_pickle.load(f, path=commit, expect=Metadata, trusted=trusted)
    except OSError as exc:
        raise CorruptCheckpointError(f"{commit}: cannot be read ({exc})", path=commit) from exc


def _crc32(
    backend: StorageBackend, path: str, progress: Callable[[int], None] | None
) -> tuple[int, int]:
    crc, size = 0, 0
    with backend.open_read(path) as f:
        while chunk := f.read(_CHUNK):
            crc = crc32(chunk, crc)
            size += len(chunk)
            if progress is not None:
                progress(len(chunk))
    return size, crc


def _expected_files(metadata: Any) -> tuple[dict[str, tuple[int, int | None]], bool]:
    """name -> (size or minimum size, crc32 or None); and whether checksums are known."""
    table = getattr(metadata, FILE_TABLE_ATTR, None)
    referenced: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        referenced[info.relative_path] = max(end, referenced.get(info.relative_path, 0))
    if table and table.get("algorithm") == "crc32":
        files: dict[str, tuple[int, int | None]] = {
            name: (int(s), int(c)) for name, (s, c) in table["files"].items()
        }
        for name in referenced.keys() - files.keys():
            files[name] = (referenced[name], None)
        return files, True
    return {name: (end, None) for name, end in referenced.items()}, False


def _size_problem(name: str, actual: int, size: int, crc: int | None) -> str | None:
    if crc is None and actual < size:
        return f"{name}: {actual} bytes, its items need at least {size}"
    if crc is not None and actual != size:
        return f"{name}: {actual} bytes, {size} were written"
    return None


def size_problems(metadata: Any, sizes: dict[str, int]) -> list[str]:
    """What is wrong with a committed checkpoint's data files, judged by their sizes alone
    (``sizes``: name -> bytes, as a directory listing gives them; no data is read): a file
    the metadata names that is missing, or not of its recorded size (the writer's table)
    or shorter than its last item (other writers). Raises ``CorruptCheckpointError`` for
    malformed metadata."""
    try:
        expected, _ = _expected_files(metadata)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"malformed metadata ({type(exc).__name__}: {exc})") from exc
    problems = []
    for name, (size, crc) in sorted(expected.items()):
        if name not in sizes:
            problems.append(f"{name}: missing")
            continue
        problem = _size_problem(name, sizes[name], size, crc)
        if problem is not None:
            problems.append(problem)
    return problems


def verify_checkpoint(
    path: str,
    *,
    use_msc: bool = False,
    checksums: bool = True,
    progress: Callable[[int], None] | None = None,
    trusted: bool = False,
) -> VerifiedCheckpoint:
    """Check the checkpoint at ``path``; raise :class:`CorruptCheckpointError` listing every
    problem (missing commit record or file, wrong size, checksum mismatch).

    ``checksums=False`` checks presence and sizes only (no data is read). ``progress`` is
    called with the byte count of every chunk checksummed. ``trusted=True`` lifts the
    restricted unpickling of the commit record (only for a checkpoint whose origin you trust:
    it may run code).
    """
    backend = get_backend(path, use_msc=use_msc)
    metadata = _load_metadata(backend, path, trusted)
    try:
        expected, has_table = _expected_files(metadata)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        commit = RecordCommit(backend, path).record_path
        raise CorruptCheckpointError(
            f"{commit}: malformed metadata ({type(exc).__name__}: {exc})", path=commit
        ) from exc
    problems: list[str] = []
    sizes: dict[str, int] = {}
    for name, (size, crc) in sorted(expected.items()):
        file_path = backend.join(path, name)
        try:
            if checksums and crc is not None:
                actual_size, actual_crc = _crc32(backend, file_path, progress)
            else:
                actual_size, actual_crc = backend.size(file_path), None
        except (FileNotFoundError, StorageError, OSError) as exc:
            problems.append(f"{name}: missing or unreadable ({exc})")
            continue
        sizes[name] = actual_size
        problem = _size_problem(name, actual_size, size, crc)
        if problem is not None:
            problems.append(problem)
        elif actual_crc is not None and actual_crc != crc:
            problems.append(f"{name}: CRC32 {actual_crc:#010x}, {crc:#010x} was written")
    if problems:
        raise CorruptCheckpointError(
            f"checkpoint {path!r} failed verification:\n  " + "\n  ".join(problems), path=path
        )
    return VerifiedCheckpoint(path, sizes, checksummed=has_table and checksums)
