"""What the trainer makes of a background DCP write: checked results, then the commit record.

:func:`checked_files` turns the report the background write left (see :mod:`._dcp_write`)
into this rank's file table, or raises :class:`~resilient_ckpt.errors.CheckpointWriteError`
naming the rank when the write failed or did not write every planned file. On the
coordinator, :func:`complete_metadata` fills DCP's metadata as torch's writer does, and
:func:`attach_file_table` adds every data file's size and CRC32 under
:data:`FILE_TABLE_ATTR` (``dcp.load`` ignores the attribute;
:func:`~resilient_ckpt.async_ckpt.verify.verify_checkpoint` checks it) before the metadata
is written as the commit record (:class:`~resilient_ckpt.storage.commit.RecordCommit`).
:class:`CommitSteps` is that finalize side of ``FileSystemWriterAsync``.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult

from .._logging import get_logger
from ..errors import CheckpointWriteError
from ..storage.commit import RecordCommit
from ._dcp_write import WriteJob, discard_report, load_report

logger = get_logger(__name__)

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


class CommitSteps:
    """The finalize side of ``FileSystemWriterAsync`` (trainer): read this rank's results
    back, and on the coordinator write the commit record. The writer holds the state."""

    checkpoint_dir: str
    sync_files: bool
    write_buckets: Any
    written_files: dict[str, tuple[int, int]]
    _backend: Any
    _job: WriteJob | None
    _expected_files: list[str] | None
    _deferred: Any

    if TYPE_CHECKING:

        def _rank(self) -> int: ...

        def storage_meta(self) -> Any: ...

    def _commit(self) -> RecordCommit:
        return RecordCommit(self._backend, self.checkpoint_dir, sync=self.sync_files)

    def retrieve_write_results(self) -> list[WriteResult]:
        """This rank's write results; raises ``CheckpointWriteError`` if the write failed."""
        if self._expected_files is None:
            what = (
                "the deferred planning of this save did not run: its request was not staged"
                if self._deferred is not None
                else "retrieve_write_results before prepare_write_data: nothing was planned"
            )
            raise CheckpointWriteError(what, rank=self._rank())
        # A save function was handed out (the payload is gone) iff a report will come: a
        # deferred save's always, even when its planning gave this rank nothing to write.
        handed_out = self.write_buckets is None
        if self._job is None or not (self._expected_files or handed_out):
            return []
        report = load_report(self._job)
        self.written_files = checked_files(report, self._expected_files, self.checkpoint_dir)
        discard_report(self._job)
        return [result for record in report.files for result in record.results]

    def finish(
        self,
        metadata: Metadata,
        results: list[list[WriteResult]],
        file_checksums: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        """Write the commit record (coordinator only, after every rank's write succeeded)."""
        complete_metadata(metadata, results, self.storage_meta())
        if file_checksums is None and len(results) == 1:
            file_checksums = self.written_files or None
        self.publish_metadata(metadata, file_checksums)

    def publish_metadata(
        self, metadata: Metadata, file_checksums: dict[str, tuple[int, int]] | None = None
    ) -> None:
        """Write ``metadata`` as the commit record, atomically, with the data files'
        checksum table (coordinator only; ``finish`` fills it in first, a finalize that
        reuses prepared metadata publishes that as it is)."""
        attach_file_table(metadata, file_checksums)
        self._commit().commit(lambda f: pickle.dump(metadata, f))
        logger.info("committed checkpoint %s", self.checkpoint_dir)

    def read_metadata(self) -> Metadata:
        """The commit record of this writer's checkpoint, as written."""
        with self._backend.open_read(self._commit().record_path) as f:
            return pickle.load(f)
