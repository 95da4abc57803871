"""The memory tier's commit pipeline: peer replicas and the commit record, off the trainer.

Per save, every rank's replicator thread runs the same steps, in save order:

1. wait (deadline) for the worker's memory-tier report of this save, which it sends over
   its channel while the call may still be writing the durable tier (or until the call
   ended without one);
2. all-gather every rank's outcome and file records (names, sizes, CRC32, DCP results);
3. inside each clique, broadcast each member's files as *one flat buffer* and write the
   peers' files next to its own (each piece checked against the CRC32 its owner reported);
4. all-gather the replica outcomes; the coordinator builds the commit record (the global
   DCP ``Metadata`` with every file's size and CRC32) and broadcasts it; every rank writes
   it into its own step directory; all-gather once more;
5. retention: only now, with a newer commit in place, older steps go.

Any failure at step 2, 3 or 4 on any rank fails the save on every rank (each removes what
it wrote for that step, its commit record first), so a step is either committed with every
shard and every replica in place, or absent. Older commits are never touched by a failed
save.

Decisions. The exchange runs in a daemon thread of the trainer on gloo groups the manager
owns (one over the world, one per clique), never on the user's groups or on the library
group the trainer thread uses for its own agreement, so the two threads' collectives
cannot interleave. The background worker process cannot do it: it has no process group.
The data crosses the network (a gloo broadcast), not a shared file system, because in a
real job the clique peers sit on other nodes. What still costs the trainer: nothing
while the exchange runs, beyond sharing the CPU; the thread's work is GIL-free (gloo
waits, ``read``/``write`` syscalls, CRC-32 over large buffers). Every wait has a
deadline: the report wait the finalize deadline, the collectives the group timeout.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .. import _checksum, _dist, _telemetry
from .._logging import get_logger
from ..async_ckpt._dcp_write import FileRecord, WriteJob, take_report
from ..async_ckpt._reports import Reports
from ..errors import (
    CheckpointingException,
    CheckpointTimeoutError,
    CheckpointWriteError,
    StorageError,
)
from ..local.replication.group_utils import CliqueGroup
from ..storage.posix import PosixBackend
from ._layout import METADATA_NAME, prune_memory, remove_step
from ._phases import PhaseHook, TieredPhase
from ._writes import commit_metadata_bytes

logger = get_logger(__name__)


@dataclass
class MemorySave:
    """One save's memory-tier work, handed from the trainer to the replicator thread."""

    step: int
    step_dir: str
    job: WriteJob | None  # None: this rank writes no data file
    metadata: Any  # the global Metadata (coordinator only)
    storage_meta: Any
    # Where the worker call's reports arrive (the queue's; ended once the call is over).
    reports: Reports | None = None
    future: Future[None] = field(default_factory=Future)
    # The save's span (telemetry; None when not traced): the replication's is its child.
    span: Any = None


class Replicator:
    """One daemon thread per manager running :class:`MemorySave` jobs in order."""

    def __init__(
        self,
        *,
        memory_dir: str,
        rank: int,
        world: Any,
        clique: CliqueGroup | None,
        keep_memory: int,
        report_timeout: float,
        on_phase: PhaseHook,
    ) -> None:
        self.memory_dir = memory_dir
        self.rank = rank
        self.world = world
        self.clique = clique
        self.keep_memory = keep_memory
        self.report_timeout = report_timeout
        self.on_phase = on_phase
        self._jobs: queue.Queue[MemorySave | None] = queue.Queue()
        self._thread = threading.Thread(
            target=self._loop, name="resilient_ckpt-tiered-replicator", daemon=True
        )
        self._thread.start()

    def submit(self, save: MemorySave) -> None:
        self._jobs.put(save)

    def close(self, timeout: float) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)

    # -- the thread -------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            save = self._jobs.get()
            if save is None:
                return
            try:
                with _telemetry.child_span(
                    save.span,
                    _telemetry.REPLICATE_SPAN,
                    **{_telemetry.STEP: save.step, _telemetry.RANK: self.rank},
                ):
                    self._run(save)
            except BaseException as exc:
                save.future.set_exception(exc)
            else:
                save.future.set_result(None)

    def _run(self, save: MemorySave) -> None:
        started = time.perf_counter()
        error, mine = self._local_outcome(save)
        outcomes = self._agree(save, "writing the memory-tier files", error, mine)
        self.on_phase(TieredPhase.MEMORY_WRITTEN, save.step)
        records: list[list[FileRecord]] = [o.payload for o in outcomes]
        self._agree(save, "storing the peers' replicas", _attempt(self._replicate, save, records))
        self.on_phase(TieredPhase.REPLICATED, save.step)
        metadata, error = self._commit_record(save, records)
        if error is None:
            error = _attempt(self._write_commit, save, metadata)
        self._agree(save, "writing the commit record", error)
        self.on_phase(TieredPhase.MEMORY_COMMITTED, save.step)
        logger.info(
            "memory tier: committed step %d (%d bytes own, replicas in %.3fs)",
            save.step,
            sum(r.size for r in records[self.rank]),
            time.perf_counter() - started,
        )
        prune_memory(self.memory_dir, self.rank, self.keep_memory, dist.get_world_size(self.world))

    def _agree(
        self, save: MemorySave, what: str, error: BaseException | None, payload: Any = None
    ) -> list[_dist.Outcome]:
        """One outcome on every rank (``_dist.agree`` on the replicator's own group); on a
        failure anywhere, this rank removes what it wrote for the step, then raises."""
        try:
            return _dist.agree(
                f"tiered save of step {save.step} ({what})",
                error,
                payload=payload,
                with_payload=True,
                group=self.world,
                details={"step": save.step},
            )
        except CheckpointingException:
            remove_step(save.step_dir)
            raise

    def _local_outcome(self, save: MemorySave) -> tuple[Exception | None, list[FileRecord]]:
        if save.job is None:
            return None, []
        try:
            report = take_report(save.job, reports=save.reports, timeout=self.report_timeout)
        except CheckpointWriteError as exc:
            return StorageError(f"memory tier of step {save.step}: {exc}"), []
        except CheckpointTimeoutError as exc:
            return exc, []
        if report.failure is not None:
            last = report.failure.strip().splitlines()[-1]
            return (
                StorageError(
                    f"rank {self.rank}: memory-tier write of step {save.step} to "
                    f"{save.step_dir!r} failed: {last}"
                ),
                [],
            )
        return None, list(report.files)

    def _replicate(self, save: MemorySave, records: list[list[FileRecord]]) -> None:
        clique = self.clique
        if clique is None or len(clique.ranks) < 2:
            return
        ranks = clique.ranks
        mine = _read_files(save.step_dir, records[self.rank])
        sizes = [sum(r.size for r in records[member]) for member in ranks]
        buffers = clique.broadcast_buffers(mine, sizes, "cpu")
        backend = PosixBackend()
        for member, buf in zip(ranks, buffers, strict=True):
            if member == self.rank:
                continue
            view = memoryview(buf.numpy())  # type: ignore[arg-type]
            offset = 0
            for record in records[member]:
                piece = view[offset : offset + record.size]
                offset += record.size
                if _checksum.crc32(piece) != record.crc32:
                    raise StorageError(
                        f"replica of {record.name} from rank {member} arrived corrupt "
                        f"(CRC32 mismatch); step {save.step} is not committed"
                    )
                with backend.open_write(os.path.join(save.step_dir, record.name), sync=False) as f:
                    f.write(piece)

    def _commit_record(
        self, save: MemorySave, records: list[list[FileRecord]]
    ) -> tuple[bytes, Exception | None]:
        """The coordinator builds the commit record and every rank receives it (the
        broadcast happens even when building failed, so no rank is left waiting)."""
        payload: list[Any] = [None]
        if self.rank == 0:
            try:
                payload[0] = commit_metadata_bytes(save.metadata, records, save.storage_meta)
            except Exception as exc:
                payload[0] = f"{type(exc).__name__}: {exc}"
        dist.broadcast_object_list(payload, src=0, group=self.world)
        if not isinstance(payload[0], bytes):
            return b"", StorageError(
                f"the coordinator could not build the commit record: {payload[0]}"
            )
        return payload[0], None

    @staticmethod
    def _write_commit(save: MemorySave, metadata: bytes) -> None:
        os.makedirs(save.step_dir, exist_ok=True)
        with PosixBackend().open_write(os.path.join(save.step_dir, METADATA_NAME), sync=False) as f:
            f.write(metadata)


def _attempt(fn: Callable[..., Any], *args: Any) -> Exception | None:
    try:
        fn(*args)
    except Exception as exc:
        return exc
    return None


def _read_files(step_dir: str, records: list[FileRecord]) -> torch.Tensor:
    """This rank's files of one step, concatenated into one uint8 buffer."""
    total = sum(r.size for r in records)
    buf = torch.empty(total, dtype=torch.uint8)
    view = memoryview(buf.numpy())  # type: ignore[arg-type]
    offset = 0
    for record in records:
        got = 0
        with open(os.path.join(step_dir, record.name), "rb", buffering=0) as f:
            while got < record.size:
                n = f.readinto(view[offset + got : offset + record.size])
                if not n:
                    break
                got += n
        if got != record.size:
            raise StorageError(
                f"{record.name} in {step_dir!r} has {got} bytes, {record.size} were written"
            )
        offset += record.size
    return buf
