"""``FileSystemWriterAsync``: a DCP storage writer whose data writes run in the background.

Call protocol (every rank; "trainer" is the training process):

0. The constructor checks the path (not a file; the directory, or the ancestor it will be
   created in, is writable), so a bad path fails on the spot, outside any collective.
1. ``set_up_storage_writer`` (trainer, from planning): creates the directory; on the
   coordinator, removes a previous commit record (``.metadata``) so the directory reads as
   "no checkpoint" while it is rewritten.
2. ``prepare_local_plan`` / ``prepare_global_plan`` (trainer, planning): as torch's writer.
3. ``prepare_write_data(plan, planner)`` (trainer): resolves every item of the final plan to
   a tensor or a byte buffer and groups them into write buckets, one per data file, balanced
   by bytes over ``thread_count`` writer threads. Nothing is copied here (views whose storage
   is larger than their bytes excepted); the snapshot is taken when the request is scheduled.
4. ``get_save_function_and_args()`` -> ``(save_fn, preload_fn, args)`` for
   ``AsyncRequest(save_fn, args, [finalize], preload_fn=preload_fn)``; ``args[1]`` is the
   bucket list, which ``preload_fn`` replaces by its host copy. ``save_fn`` runs in the
   background process (see :mod:`._dcp_write`) and writes ``__<rank>_<k>.distcp`` files plus
   a per-rank results file (``__<rank>.write_results``, removed once read unless it reports
   a failure).
5. ``retrieve_write_results()`` (trainer, finalize): this rank's ``WriteResult`` list, read
   back from the results file; raises :class:`~resilient_ckpt.errors.CheckpointWriteError`
   when the write failed or did not report.
6. ``finish(metadata, results)`` (coordinator, finalize, after all ranks succeeded): writes
   the commit record ``.metadata`` last, atomically (temporary name, fsync, rename, directory
   fsync), including a table of every data file's size and CRC32 that ``dcp.load`` ignores and
   :func:`resilient_ckpt.async_ckpt.verify.verify_checkpoint` checks.

A writer holds the state of one save; create one per checkpoint, as with NVRx. All I/O goes
through the storage backend chosen by the path (``msc://`` or ``use_msc``), so object stores
plug in without changes here.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pickle
import tempfile
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .. import _dist
from .._logging import get_logger
from ..config import RetryPolicy
from ..errors import CheckpointExistsError, CheckpointWriteError, ConfigurationError, StorageError
from ..storage import PosixBackend, get_backend
from ..storage.base import is_msc_url
from ..storage.commit import RecordCommit
from ._dcp_buckets import build_buckets
from ._dcp_write import (
    FileRecord,
    WriteBucket,
    WriteJob,
    discard_report,
    load_report,
    run_write_job,
    write_file,
)

logger = get_logger(__name__)

__all__ = ["FileSystemWriterAsync", "get_write_results_queue"]

# Extra attribute of the pickled Metadata (dcp.load ignores it): {"algorithm", "files"}.
FILE_TABLE_ATTR = "resilient_ckpt_files"

# NVRx/Megatron probe for this attribute; our writer returns results through a file instead.
_results_queue: Any = None


def get_write_results_queue(mp_mode: str = "spawn") -> Any:
    """A multiprocessing manager queue, created once (NVRx compatibility; unused here)."""
    global _results_queue
    if _results_queue is None:
        import multiprocessing as mp

        _results_queue = mp.get_context(mp_mode).Manager().Queue()
    return _results_queue


def _checkpoint_dir(path: Any) -> str:
    if isinstance(path, (str, os.PathLike)):
        return os.fspath(path) if not isinstance(path, str) else path
    raise ConfigurationError(f"checkpoint path must be a str or os.PathLike, got {path!r}")


class FileSystemWriterAsync(FileSystemWriter):
    """DCP ``FileSystemWriter`` that writes in the background; see the module docstring.

    Args:
        path: checkpoint directory (or ``msc://profile/path``).
        separation_hint: keys starting with it are written to separate files.
        use_msc: use the multi-storage-client backend (requires an ``msc://`` path; any
            ``msc://`` path uses it anyway).
        retry_policy: retries of object-store operations (default: from the environment,
            see :mod:`resilient_ckpt.config`).
        *args, **kwargs: ``FileSystemWriter``'s (``single_file_per_rank``, ``sync_files``,
            ``thread_count``, ``per_thread_copy_ahead``, ``overwrite``, ...).
    """

    can_run_decentralized_global_plan: bool = True

    def __init__(
        self,
        path: str | os.PathLike,
        *args: Any,
        separation_hint: str | None = None,
        use_msc: bool = False,
        retry_policy: RetryPolicy | None = None,
        **kwargs: Any,
    ) -> None:
        checkpoint_dir = _checkpoint_dir(path)
        self.retry_policy = retry_policy
        self._backend = get_backend(checkpoint_dir, use_msc=use_msc, retry=retry_policy)
        super().__init__(checkpoint_dir, *args, **kwargs)
        self.checkpoint_dir = checkpoint_dir
        self.use_msc = use_msc or is_msc_url(checkpoint_dir)
        self.separation_hint = separation_hint
        self._validate_options(checkpoint_dir)
        self.is_coordinator = False
        self.rank: int | None = getattr(self, "rank", None)
        self.use_collectives: bool = getattr(self, "use_collectives", True)
        self.write_buckets: list[WriteBucket] | None = None
        self.results_queue: Any = None
        self.written_files: dict[str, tuple[int, int]] = {}
        self._job: WriteJob | None = None

    def _validate_options(self, checkpoint_dir: str) -> None:
        if not isinstance(self.thread_count, int) or self.thread_count < 1:
            raise ConfigurationError(f"thread_count must be an int >= 1, got {self.thread_count!r}")
        if self.separation_hint is not None and (
            not isinstance(self.separation_hint, str) or not self.separation_hint
        ):
            raise ConfigurationError(
                f"separation_hint must be a non-empty str or None, got {self.separation_hint!r}"
            )
        fmt = getattr(self, "serialization_format", None)
        if fmt is not None and getattr(fmt, "value", fmt) != "torch_save":
            raise ConfigurationError(
                f"FileSystemWriterAsync writes the torch_save format only, got {fmt!r}"
            )
        if isinstance(self._backend, PosixBackend):
            if os.path.exists(checkpoint_dir) and not os.path.isdir(checkpoint_dir):
                raise ConfigurationError(
                    f"checkpoint path {checkpoint_dir!r} exists and is not a directory"
                )
            _probe_writable(_nearest_existing_dir(checkpoint_dir))

    # -- planning (trainer) -----------------------------------------------------------------

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)
        self._prepare_directory()

    def _commit(self) -> RecordCommit:
        return RecordCommit(self._backend, self.checkpoint_dir, sync=self.sync_files)

    def _prepare_directory(self) -> None:
        self._backend.makedirs(self.checkpoint_dir)
        if not self.is_coordinator:
            return
        commit = self._commit()
        if commit.is_committed():
            if not self.overwrite:
                raise CheckpointExistsError(
                    f"a checkpoint is already committed in {self.checkpoint_dir!r} and the "
                    "writer has overwrite=False"
                )
            logger.warning("overwriting the checkpoint in %s", self.checkpoint_dir)
            # Uncommit first, durably: while new data files replace old ones, nobody may load
            # them, not even after a crash.
            commit.uncommit()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self.rank is not None and not self.use_collectives:
            plan = dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{self.rank}_"))
        return plan

    def prepare_decentralized_global_plan(self, local_plan: SavePlan) -> SavePlan:
        """The coordinator would name this rank's files ``__<rank>_``; do it locally."""
        return dataclasses.replace(local_plan, storage_data=_StoragePrefix(f"__{self._rank()}_"))

    def _rank(self) -> int:
        if self.rank is not None:
            return int(self.rank)
        return _dist.rank()

    # -- preparing the background write (trainer) -------------------------------------------

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        """Resolve the final plan's items and group them into per-file write buckets."""
        storage = plan.storage_data
        if not isinstance(storage, _StoragePrefix):
            raise ConfigurationError(
                "the final save plan has no storage prefix; plan with "
                "save_state_dict_async_plan (it runs prepare_global_plan)"
            )
        self.write_buckets = build_buckets(
            plan,
            planner,
            prefix=storage.prefix,
            join=self._backend.join,
            checkpoint_dir=self.checkpoint_dir,
            thread_count=self.thread_count,
            single_file_per_rank=self.single_file_per_rank,
            separation_hint=self.separation_hint,
        )
        self._job = WriteJob(
            checkpoint_dir=self.checkpoint_dir,
            use_msc=self.use_msc,
            rank=self._rank(),
            token=uuid.uuid4().hex,
            sync_files=self.sync_files,
            thread_count=self.thread_count,
            transforms=getattr(self, "transforms", None),
            retry=self.retry_policy,
        )
        self.written_files = {}
        self.results_queue = None

    def get_save_function_and_args(self) -> tuple[Any, Any, tuple]:
        """``(save_fn, preload_fn, args)``, or ``(None, None, ())`` when this rank writes
        nothing. ``preload_fn()`` returns the buckets with tensors on the host; its result
        replaces ``args[1]``."""
        if not self.write_buckets or self._job is None:
            return None, None, ()
        save_fn = functools.partial(type(self).write_preloaded_data_multithread, self._job)
        preload_fn = functools.partial(type(self).preload_tensors, self.write_buckets, True)
        return save_fn, preload_fn, (self._job.rank, self.write_buckets)

    @staticmethod
    def preload_tensors(
        write_buckets: list[WriteBucket], non_blocking: bool = True
    ) -> list[WriteBucket]:
        """The buckets with every tensor on the host (device tensors copied; CPU ones as is)."""
        moved_from_device = False
        result: list[WriteBucket] = []
        for path, name, (bytes_data, tensor_data) in write_buckets:
            host = []
            for item, tensor in tensor_data:
                if tensor.device.type != "cpu":
                    moved_from_device = True
                    tensor = tensor.to("cpu", non_blocking=non_blocking)
                host.append((item, tensor))
            result.append((path, name, (bytes_data, host)))
        if moved_from_device and non_blocking and torch.cuda.is_available():
            torch.cuda.synchronize()
        return result

    # -- the background write ---------------------------------------------------------------

    @classmethod
    def write_preloaded_data_multithread(
        cls, job: WriteJob, rank: int, write_buckets: list[WriteBucket]
    ) -> None:
        """Background entry point: write every bucket with ``job.thread_count`` threads."""
        run_write_job(job, write_buckets, functools.partial(cls.write_preloaded_data, job))

    @classmethod
    def write_preloaded_data(cls, job: WriteJob, write_bucket: WriteBucket) -> FileRecord:
        """Write one data file (runs on a writer thread; a hook for subclasses and tests)."""
        return write_file(job, write_bucket)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Synchronous write, so the writer also works with ``dcp.save``."""
        self.prepare_write_data(plan, planner)
        save_fn, preload_fn, args = self.get_save_function_and_args()
        if save_fn is not None:
            save_fn(args[0], preload_fn())
        future: Future[list[WriteResult]] = Future()
        future.set_result(self.retrieve_write_results())
        return future

    # -- finalize (trainer) -----------------------------------------------------------------

    def retrieve_write_results(self) -> list[WriteResult]:
        """This rank's write results; raises ``CheckpointWriteError`` if the write failed."""
        if self.write_buckets is None:
            raise CheckpointWriteError(
                "retrieve_write_results before prepare_write_data: nothing was planned",
                rank=self._rank(),
            )
        if not self.write_buckets or self._job is None:
            return []
        report = load_report(self._job)
        if report.failure is not None:
            raise CheckpointWriteError(
                f"rank {report.rank}: writing checkpoint files in {self.checkpoint_dir!r} "
                f"failed in the background:\n{report.failure}",
                rank=report.rank,
                path=self.checkpoint_dir,
            )
        expected = {name for _, name, _ in self.write_buckets}
        written = {record.name for record in report.files}
        if written != expected:
            raise CheckpointWriteError(
                f"rank {report.rank}: incomplete write: expected files {sorted(expected)}, "
                f"the background write reported {sorted(written)}",
                rank=report.rank,
                path=self.checkpoint_dir,
            )
        self.written_files = {r.name: (r.size, r.crc32) for r in report.files}
        discard_report(self._job)
        return [result for record in report.files for result in record.results]

    def finish(
        self,
        metadata: Metadata,
        results: list[list[WriteResult]],
        file_checksums: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        """Write the commit record (coordinator only, after every rank's write succeeded)."""
        metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
        metadata.storage_meta = self.storage_meta()
        version = _dcp_version()
        if version is not None:
            metadata.version = version
        if file_checksums is None and len(results) == 1:
            file_checksums = self.written_files or None
        if file_checksums:
            table = {"algorithm": "crc32", "files": dict(file_checksums)}
            setattr(metadata, FILE_TABLE_ATTR, table)
        else:
            metadata.__dict__.pop(FILE_TABLE_ATTR, None)
        self._commit().commit(lambda f: pickle.dump(metadata, f))
        logger.info("committed checkpoint %s", self.checkpoint_dir)

    # -- identity -----------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        if checkpoint_id:
            self.checkpoint_dir = _checkpoint_dir(checkpoint_id)
            self._backend = get_backend(
                self.checkpoint_dir, use_msc=self.use_msc, retry=self.retry_policy
            )
        self.write_buckets = None
        self.written_files = {}
        self._job = None

    @property
    def checkpoint_id(self) -> str | os.PathLike:
        return self.checkpoint_dir

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True


def _nearest_existing_dir(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _probe_writable(directory: str) -> None:
    """Create and remove a file in ``directory`` (the checkpoint directory or the ancestor
    it will be created in): the one reliable check, as root ignores permission bits. Done
    once, when the writer is made, so a bad path fails there, before any collective."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".resilient_ckpt_probe-", dir=directory)
    except OSError as exc:
        raise StorageError(
            f"checkpoint directory {directory!r} is not writable: {exc.strerror or exc}"
        ) from exc
    os.close(fd)
    os.unlink(probe)


def _dcp_version() -> str | None:
    from torch.distributed.checkpoint import filesystem

    return getattr(filesystem, "CURRENT_DCP_VERSION", None)
