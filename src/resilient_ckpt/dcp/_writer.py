"""``FileSystemWriter``: this package's DCP files and commit, inside torch's own ``dcp.save``.

Decision: the writer *is* :class:`~resilient_ckpt.async_ckpt.filesystem_async.FileSystemWriterAsync`
(same data files, fsync, ``.metadata`` last and atomic, the checksum table) with one
difference: under torch's ``dcp.save`` (and so under ``dcp.async_save``'s thread and process
executors, which call it), every rank's CRC-32s reach the coordinator that writes the commit
record. torch's save gives the writer one channel between ranks: the write results, gathered
on the coordinator and handed to ``finish``. So each rank appends one more ``WriteResult`` to
its own, whose index names no item of the state (:data:`CHECKSUMS_FQN`) and whose
``storage_data`` is that rank's ``{file: (size, crc32)}``; ``finish`` takes these out before
the metadata is built, so ``.metadata`` holds exactly what torch's would plus the table that
``resilient-ckpt verify`` checks. Alternatives: a collective of our own inside ``finish``
(only the coordinator calls it: it would wait forever), a side file per rank (another file
to publish atomically and clean up, and a directory listing at commit), or a ``_StorageInfo``
subclass carrying the checksum (a class of ours pickled into ``.metadata``, which plain
``torch`` could then not load). Under this package's own engine
(:func:`resilient_ckpt.dcp.async_save`) the checksums travel in the finalize's gather as for
``FileSystemWriterAsync``, and no extra result is made.

The class is importable and its instances pickle (the process executor sends the writer to
its daemon), holding no state of a save until ``set_up_storage_writer``.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..async_ckpt.filesystem_async import FileSystemWriterAsync
from ..errors import CheckpointWriteError

__all__ = ["CHECKSUMS_FQN", "FileSystemWriter"]

# The index of the extra write result that carries a rank's checksums to ``finish``: a name
# no state dict key can collide with in practice, and never written to ``.metadata``.
CHECKSUMS_FQN = "\x00resilient_ckpt.file_checksums"


def _is_checksums(result: WriteResult) -> bool:
    return getattr(result.index, "fqn", None) == CHECKSUMS_FQN


class FileSystemWriter(FileSystemWriterAsync):
    """A DCP ``StorageWriter`` for torch's ``dcp.save`` and ``dcp.async_save``, and for
    :func:`resilient_ckpt.dcp.async_save`, writing what ``FileSystemWriterAsync`` writes.

    Call protocol under torch's ``dcp.save`` (every rank, in the process that runs the save:
    the trainer, the thread executor's thread, or the process executor's daemon):
    ``set_up_storage_writer`` -> ``prepare_local_plan`` -> (coordinator)
    ``prepare_global_plan`` -> ``write_data`` (writes this rank's files, fsyncs them, returns
    their write results plus one carrying their checksums) -> (coordinator, after every rank
    succeeded) ``finish``, which writes ``.metadata`` last, atomically, with every rank's
    checksums. A rank's failed write raises from ``write_data``; torch then raises on every
    rank and nothing is committed.

    Args:
        path: the checkpoint directory (or ``msc://profile/path``).
        **kwargs: ``FileSystemWriterAsync``'s and torch ``FileSystemWriter``'s options
            (``thread_count``, ``sync_files``, ``single_file_per_rank``, ``overwrite``, ...).
    """

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = super().write_data(plan, planner).value()
        carrier = WriteResult(
            index=MetadataIndex(CHECKSUMS_FQN),
            size_in_bytes=0,
            storage_data=dict(self.written_files),
        )
        future: Future[list[WriteResult]] = Future()
        future.set_result([*results, carrier])
        return future

    def finish(
        self,
        metadata: Metadata,
        results: list[list[WriteResult]],
        file_checksums: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        """Write the commit record (coordinator only, after every rank's write succeeded),
        with the checksums each rank's results carried."""
        carried: dict[str, tuple[int, int]] = {}
        cleaned = []
        for rank_results in results:
            kept = []
            for result in rank_results:
                if _is_checksums(result):
                    carried.update(_checked_table(result.storage_data, self.checkpoint_dir))
                else:
                    kept.append(result)
            cleaned.append(kept)
        if file_checksums is None and carried:
            file_checksums = carried
        super().finish(metadata, cleaned, file_checksums=file_checksums)


def _checked_table(table: Any, checkpoint_dir: str) -> dict[str, tuple[int, int]]:
    if not isinstance(table, dict) or not all(
        isinstance(name, str) and isinstance(entry, tuple) and len(entry) == 2
        for name, entry in table.items()
    ):
        raise CheckpointWriteError(
            f"a rank's checksum table for {checkpoint_dir!r} is malformed ({type(table).__name__}):"
            " every rank must save with resilient_ckpt.dcp.FileSystemWriter",
            path=checkpoint_dir,
        )
    return {name: (int(size), int(crc)) for name, (size, crc) in table.items()}
