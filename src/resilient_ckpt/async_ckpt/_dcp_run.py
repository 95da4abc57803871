"""Running a rank's background DCP write: lanes of files on threads or child processes,
then the results file the trainer reads back (see :mod:`._dcp_write` for one file).

* **Threads, all started first.** Files are dealt to ``thread_count`` lanes balanced by
  bytes; every extra lane's thread starts before the calling thread writes its own lane, so
  the lanes really overlap (``torch.save`` and ``write`` release the GIL for the data).
  With ``multiproc_io`` the extra lanes are child processes of the background worker.
* **Results travel through a file** (``__<rank>.write_results``), written atomically before
  any commit: a write failure is recorded there rather than raised, so finalize still runs
  on every rank and reports it everywhere; the trainer removes the file once read, unless
  it reports a failure.
"""

from __future__ import annotations

import heapq
import multiprocessing as mp
import os
import pickle
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from .._logging import get_logger
from ..errors import CheckpointWriteError
from ._dcp_write import (
    FileRecord,
    RankWriteReport,
    WriteBucket,
    WriteJob,
    bucket_nbytes,
)
from ._worker import arm_parent_death_signal

logger = get_logger(__name__)


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
    """Body of one writer process (forked): write its files, send the records or the
    failure's text, exit without running the parent's exit handlers."""
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
    """One forked process per lane (``is_multiproc_io``): the outcome of each lane, in
    order: its records, or an exception. The fork shares the staged tensors copy-on-write,
    so nothing is copied to hand them over."""
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
    """Write every bucket with up to ``thread_count`` threads (or forked processes, with
    ``processes``); raise the first failure."""
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
    """Write this rank's files, then record the outcome in its results file."""
    started = time.perf_counter()
    report = RankWriteReport(job.token, job.rank)
    try:
        report.files = write_all(buckets, job.thread_count, write_one, processes=job.multiproc_io)
    except Exception as exc:
        report.failure = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        logger.error("writing checkpoint files in %s failed: %r", job.checkpoint_dir, exc)
    report.seconds = time.perf_counter() - started
    try:
        _store_report(job, report)
    except Exception as exc:
        raise CheckpointWriteError(
            f"rank {job.rank}: could not record the write results in {job.checkpoint_dir!r} "
            f"({exc!r}); write outcome: {report.failure or 'success'}",
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


def _store_report(job: WriteJob, report: RankWriteReport) -> None:
    backend = job.backend()
    path = backend.join(job.checkpoint_dir, job.results_name)
    with backend.open_write(path, sync=job.sync_files) as f:
        pickle.dump(report, f, protocol=pickle.HIGHEST_PROTOCOL)


def discard_report(job: WriteJob) -> None:
    """Remove a results file that was read successfully (failed ones stay for post-mortem)."""
    backend = job.backend()
    try:
        backend.delete(backend.join(job.checkpoint_dir, job.results_name))
    except OSError as exc:
        logger.debug("could not remove %s: %r", job.results_name, exc)


def load_report(job: WriteJob) -> RankWriteReport:
    """Read this rank's results file (trainer side); named errors when absent or foreign."""
    backend = job.backend()
    path = backend.join(job.checkpoint_dir, job.results_name)
    try:
        with backend.open_read(path) as f:
            report = pickle.load(f)
    except FileNotFoundError as exc:
        raise CheckpointWriteError(
            f"rank {job.rank}: no write results at {path!r}: the background write did not run "
            "or did not finish (was the AsyncRequest scheduled and waited for?)",
            rank=job.rank,
            path=path,
        ) from exc
    except Exception as exc:
        raise CheckpointWriteError(
            f"rank {job.rank}: unreadable write results at {path!r}: {exc!r}",
            rank=job.rank,
            path=path,
        ) from exc
    if not isinstance(report, RankWriteReport) or report.token != job.token:
        raise CheckpointWriteError(
            f"rank {job.rank}: {path!r} holds the results of another save (stale file or two "
            "saves into one directory at once); this save's write did not report",
            rank=job.rank,
            path=path,
        )
    return report
