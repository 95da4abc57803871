"""What the trainer makes of a background DCP write: checked results, then the commit record.

:func:`checked_files` turns the report the background write left (see :mod:`._dcp_write`)
into this rank's file table, or raises :class:`~resilient_ckpt.errors.CheckpointWriteError`
naming the rank when the write failed or did not write every planned file. On the
coordinator, :func:`complete_metadata` fills DCP's metadata as torch's writer does, and
:func:`attach_file_table` adds every data file's size and CRC32 under
:data:`FILE_TABLE_ATTR` (``dcp.load`` ignores the attribute;
:func:`~resilient_ckpt.async_ckpt.verify.verify_checkpoint` checks it) before the metadata
is written as the commit record (:class:`~resilient_ckpt.storage.commit.RecordCommit`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult

from ..errors import CheckpointWriteError

# Extra attribute of the pickled Metadata (dcp.load ignores it): {"algorithm", "files"}.
FILE_TABLE_ATTR = "resilient_ckpt_files"


def checked_files(
    report: Any, expected_files: Sequence[str], checkpoint_dir: str
) -> dict[str, tuple[int, int]]:
    """``{file name: (size, crc32)}`` of a complete background write; raises otherwise."""
    if report.failure is not None:
        raise CheckpointWriteError(
            f"Worker failure on rank {report.rank}: writing checkpoint files in "
            f"{checkpoint_dir!r} failed in the background:\n{report.failure}",
            rank=report.rank,
            path=checkpoint_dir,
        )
    expected = set(expected_files)
    written = {record.name for record in report.files}
    if written != expected:
        raise CheckpointWriteError(
            f"rank {report.rank}: incomplete write: expected files {sorted(expected)}, "
            f"the background write reported {sorted(written)}",
            rank=report.rank,
            path=checkpoint_dir,
        )
    return {r.name: (r.size, r.crc32) for r in report.files}


def complete_metadata(
    metadata: Metadata, results: list[list[WriteResult]], storage_meta: Any
) -> None:
    """Where every item landed, the storage identity and DCP's format version."""
    metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
    metadata.storage_meta = storage_meta
    version = _dcp_version()
    if version is not None:
        metadata.version = version


def attach_file_table(
    metadata: Metadata, file_checksums: dict[str, tuple[int, int]] | None
) -> None:
    """Record (or, without checksums, drop) the table of data files' sizes and CRC32s."""
    if file_checksums:
        table = {"algorithm": "crc32", "files": dict(file_checksums)}
        setattr(metadata, FILE_TABLE_ATTR, table)
    else:
        metadata.__dict__.pop(FILE_TABLE_ATTR, None)


def _dcp_version() -> str | None:
    from torch.distributed.checkpoint import filesystem

    return getattr(filesystem, "CURRENT_DCP_VERSION", None)
