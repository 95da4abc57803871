"""``FileSystemWriterAsync``: a DCP storage writer whose data writes run in the background.

Call protocol (every rank; "trainer" is the training process):

0. The constructor checks options and the path, so a bad one fails on that rank at once,
   outside any collective where the other ranks would wait.
1. ``set_up_storage_writer`` (trainer, planning): creates the directory; the coordinator
   removes a previous commit record (``.metadata``), so the directory reads as "no
   checkpoint" while it is rewritten.
2. ``prepare_local_plan`` / ``prepare_global_plan`` (trainer, planning): as torch's writer.
3. ``prepare_write_data(plan, planner)`` (trainer): resolves every item of the final plan and
   groups them into write buckets, one per data file, balanced over ``thread_count``
   threads. Nothing is copied: the snapshot is taken when the request is scheduled. A save
   made with ``defer_planning=True`` calls ``defer_write_data(plan)`` instead: the planning
   (and with it this step) runs where the request is staged.
4. ``get_save_function_and_args()`` -> ``(save_fn, preload_fn, args)`` for
   ``AsyncRequest(save_fn, args, [finalize], preload_fn=preload_fn)``; ``args[1]`` is the
   bucket list, which ``preload_fn`` replaces by its host copy (a deferred save's
   ``preload_fn`` is its planning, a :class:`._staging.PlanStep`, and ``args[1]`` None until
   it ran). ``save_fn`` runs in the
   background process (:mod:`._dcp_write`), writes the ``__<rank>_<k>.distcp`` files and
   sends their report (sizes, CRC32s, each file's write results encoded as rows, or the
   failure) back over the worker's channel (:mod:`._reports`); nothing else is written into
   the checkpoint.
5. ``retrieve_write_results()`` (trainer, finalize): this rank's ``WriteResult`` list from
   that report (the finalize takes ``retrieve_write_rows()``, the rows undecoded); raises
   :class:`~resilient_ckpt.errors.CheckpointWriteError` when the write failed, did not
   write every planned file, or did not report.
6. ``finish(metadata, results)`` (coordinator, finalize, after all ranks succeeded): writes
   ``.metadata`` last and atomically (:class:`~resilient_ckpt.storage.commit.RecordCommit`),
   with a table of every data file's size and CRC32 (:data:`FILE_TABLE_ATTR`) that
   ``dcp.load`` ignores and :func:`resilient_ckpt.async_ckpt.verify.verify_checkpoint` checks.

A writer holds the state of one save; create one per checkpoint, as with NVRx. All I/O goes
through the storage backend the path selects (``msc://`` or ``use_msc``).

The directory check creates and removes a file (the one reliable test: root ignores
permission bits), once per directory and process: jobs make a writer per save under the same
parent, and each probe is metadata operations on a parallel file system from every rank.
Object stores have no directories; their first upload reports a bad profile or bucket.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pickle
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .. import _dist, _restricted_pickle
from .._logging import get_logger
from .._rank_errors import local_failure as _wrap_exception
from .._rank_errors import wrap_for_gather
from .._torch_compat import prefix_of, storage_prefix
from ..config import RetryPolicy
from ..errors import (
    CheckpointExistsError,
    CheckpointWriteError,
    ConfigurationError,
    FrozenRequestError,
    InvalidRequestError,
)
from ..storage import PosixBackend, get_backend
from ..storage.base import is_msc_url
from ..storage.commit import RecordCommit
from ..storage.posix import probe_writable
from ._dcp_buckets import WritePayload, buckets_of, build_buckets, host_buckets
from ._dcp_write import (
    FileRecord,
    WriteBucket,
    WriteJob,
    decode_results,
    run_write_job,
    take_report,
    write_file,
)
from ._nvrx import WriteResultsQueue, WriterNames
from ._staging import PlanStep

logger = get_logger(__name__)

__all__ = ["FileSystemWriterAsync", "get_write_results_queue"]

# Extra attribute of the pickled Metadata (dcp.load ignores it): {"algorithm", "files"}.
FILE_TABLE_ATTR = "resilient_ckpt_files"

# NVRx's module global: Megatron-LM probes for it and shuts its manager down (see ._nvrx).
_results_queue: WriteResultsQueue | None = None


def _wrap_exception_for_gather(exc: BaseException) -> Any:
    """This rank's write failure as the picklable ``(exception, stack summary)`` pair the finalize
    gathers (:func:`resilient_ckpt._rank_errors.wrap_for_gather`). ``_wrap_exception`` is looked
    up here at each call, as in NVRx, whose tests replace it.
    """
    return wrap_for_gather(exc, _wrap_exception)


def get_write_results_queue(mp_mode: str = "spawn") -> WriteResultsQueue:
    """NVRx's results queue, created on the first call: an in-process queue that nothing here
    uses (:class:`._nvrx.WriteResultsQueue`, for Megatron-LM's calls)."""
    global _results_queue
    if _results_queue is None:
        _results_queue = WriteResultsQueue(mp_mode)
    return _results_queue


# -- what the constructor checks -------------------------------------------------------------


def _check_flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(f"FileSystemWriterAsync({name}=...) must be a bool, got {value!r}")
    return value


def _check_open_file(open_file: Any, use_msc: bool, checkpoint_dir: str) -> Callable[..., Any]:
    if not callable(open_file):
        raise ConfigurationError(
            f"FileSystemWriterAsync(open_file=...) must be callable like open(path, mode), "
            f"got {open_file!r}"
        )
    if open_file is not open and (use_msc or is_msc_url(checkpoint_dir)):
        raise ConfigurationError(
            "FileSystemWriterAsync(open_file=...) applies to local paths only; with msc the "
            "multi-storage-client opens the objects (drop open_file or use_msc)"
        )
    return open_file


def _checkpoint_dir_of(path: Any) -> str:
    if isinstance(path, (str, os.PathLike)):
        return os.fspath(path) if not isinstance(path, str) else path
    raise ConfigurationError(f"checkpoint path must be a str or os.PathLike, got {path!r}")


def _check_writer_options(writer: Any, checkpoint_dir: str, *, local: bool) -> None:
    """The options ``FileSystemWriter`` stored on ``writer``, and a ``local`` path itself."""
    if not isinstance(writer.thread_count, int) or writer.thread_count < 1:
        raise ConfigurationError(f"thread_count must be an int >= 1, got {writer.thread_count!r}")
    hint = writer.separation_hint
    if hint is not None and (not isinstance(hint, str) or not hint):
        raise ConfigurationError(f"separation_hint must be a non-empty str or None, got {hint!r}")
    fmt = getattr(writer, "serialization_format", None)
    if fmt is not None and getattr(fmt, "value", fmt) != "torch_save":
        raise ConfigurationError(
            f"FileSystemWriterAsync writes the torch_save format only, got {fmt!r}"
        )
    if local:
        if os.path.exists(checkpoint_dir) and not os.path.isdir(checkpoint_dir):
            raise ConfigurationError(
                f"checkpoint path {checkpoint_dir!r} exists and is not a directory"
            )
        _probe_writable(_nearest_existing_dir(checkpoint_dir))


def _nearest_existing_dir(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


# Directories a probe found writable, most recent last (see the module docstring: probing a
# parent once per process is enough).
_PROBED: OrderedDict[str, None] = OrderedDict()
_PROBED_MAX = 64
_probed_lock = threading.Lock()


def _probe_writable(directory: str) -> None:
    """``probe_writable`` on ``directory``, once per directory and process."""
    with _probed_lock:
        if directory in _PROBED:
            _PROBED.move_to_end(directory)
            return
    probe_writable(directory)
    with _probed_lock:
        _PROBED[directory] = None
        while len(_PROBED) > _PROBED_MAX:
            _PROBED.popitem(last=False)


# -- checking the results, filling the commit record ------------------------------------------


def _checked_files(
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


def _complete_metadata(
    metadata: Metadata, results: list[list[WriteResult]], storage_meta: Any
) -> None:
    """Where every item landed, the storage identity and DCP's format version."""
    metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
    metadata.storage_meta = storage_meta
    version = _dcp_version()
    if version is not None:
        metadata.version = version


def _attach_file_table(
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


class FileSystemWriterAsync(WriterNames, FileSystemWriter):
    """DCP ``FileSystemWriter`` that writes in the background; the call protocol is in the module
    note.

    Args:
        path: checkpoint directory (or ``msc://profile/path``).
        separation_hint: keys starting with it are written to separate files.
        use_msc: write through the multi-storage-client backend: an ``msc://`` path (which
            uses it anyway), or a plain path served by MSC's POSIX provider.
        is_multiproc_io: write the data files with child processes of the background
            worker instead of threads (a daemon worker cannot have children: use
            ``AsyncCallsQueue(is_daemon=False)``; otherwise the save fails, naming this).
        use_cached_data_structure, use_cpu_shm_for_gpu_tensors: NVRx's staging switches,
            accepted for compatibility; our staging always copies tensors (CUDA ones included)
            into reused host shared memory.
        open_file: the function that opens each data file for writing (called as
            ``open_file(path, "wb")``; default: the built-in ``open``). It travels to the
            background worker, so it must be picklable. Local paths only.
        retry_policy: retries of object-store operations (default: from the environment,
            see :mod:`resilient_ckpt.config`).
        *args, **kwargs: ``FileSystemWriter``'s (``single_file_per_rank``, ``sync_files``,
            ``thread_count``, ``per_thread_copy_ahead``, ``overwrite``, ...).
    """

    can_run_decentralized_global_plan: bool = True
    # Pad tensor items to 64-byte boundaries (the tiered manager sets it; see WriteJob).
    align_items: bool = False

    def __init__(
        self,
        path: str | os.PathLike,
        *args: Any,
        separation_hint: str | None = None,
        use_msc: bool = False,
        is_multiproc_io: bool = False,
        use_cached_data_structure: bool = False,
        use_cpu_shm_for_gpu_tensors: bool = False,
        retry_policy: RetryPolicy | None = None,
        **kwargs: Any,
    ) -> None:
        checkpoint_dir = _checkpoint_dir_of(path)
        self.open_file = _check_open_file(kwargs.pop("open_file", open), use_msc, checkpoint_dir)
        self.is_multiproc_io = _check_flag("is_multiproc_io", is_multiproc_io)
        self.use_cached_data_structure = _check_flag(
            "use_cached_data_structure", use_cached_data_structure
        )
        self.use_cpu_shm_for_gpu_tensors = _check_flag(
            "use_cpu_shm_for_gpu_tensors", use_cpu_shm_for_gpu_tensors
        )
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
        self._payload: Any = None  # a WritePayload until handed out (or planned, if deferred)
        self.written_files: dict[str, tuple[int, int]] = {}
        self._job: WriteJob | None = None
        self._expected_files: list[str] | None = None
        # A deferred save (defer_write_data): its planning until handed out, and whether
        # that planning is running now.
        self._deferred = False
        self._plan_step: PlanStep | None = None
        self._planning = False

    @property
    def write_buckets(self) -> list[WriteBucket] | None:
        """The prepared save's write buckets until they are handed out (NVRx's attribute): plain
        ``(path, name, (bytes_data, [(item, tensor), ...]))`` tuples, each tensor a new detached
        one; None once handed out, and for a deferred save until its planning ran."""
        if isinstance(self._payload, WritePayload):
            return self._payload.buckets()
        return self._payload  # type: ignore[no-any-return]

    @write_buckets.setter
    def write_buckets(self, value: Any) -> None:
        self._payload = value

    @property
    def has_data_to_write(self) -> bool:
        """Whether this rank's prepared save writes any file (NVRx's name); always True for a
        deferred save, which runs its save function.
        """
        return self._deferred or bool(self._expected_files)

    def _validate_options(self, checkpoint_dir: str) -> None:
        _check_writer_options(self, checkpoint_dir, local=isinstance(self._backend, PosixBackend))

    # -- planning (trainer) -----------------------------------------------------------------

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)
        self._prepare_directory()

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
            plan = dataclasses.replace(plan, storage_data=storage_prefix(f"__{self.rank}_"))
        return plan

    def prepare_decentralized_global_plan(self, local_plan: SavePlan) -> SavePlan:
        """The coordinator would name this rank's files ``__<rank>_``; do it locally."""
        return dataclasses.replace(local_plan, storage_data=storage_prefix(f"__{self._rank()}_"))

    def _rank(self) -> int:
        if self.rank is not None:
            return int(self.rank)
        return _dist.rank()

    # -- preparing the background write (trainer) -------------------------------------------

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        """Resolve the final plan's items and group them into per-file write buckets."""
        prefix = prefix_of(plan.storage_data)
        if prefix is None:
            raise ConfigurationError(
                "the final save plan has no storage prefix; plan with "
                "save_state_dict_async_plan (it runs prepare_global_plan)"
            )
        buckets = build_buckets(
            plan,
            planner,
            prefix=prefix,
            join=self._backend.join,
            checkpoint_dir=self.checkpoint_dir,
            thread_count=self.thread_count,
            single_file_per_rank=self.single_file_per_rank,
            separation_hint=self.separation_hint,
        )
        self._expected_files = buckets.names
        self._payload = buckets
        if self._planning:
            # A deferred save's planning, which returns the buckets: its save function
            # (bound to its job) was handed out already.
            return
        self._deferred = False  # a deferred save of this writer's that is over
        self._job = self._new_job()
        self.written_files = {}

    def defer_write_data(self, plan: Callable[[], None]) -> None:
        """Prepare a save planned when its request is staged (:class:`._staging.PlanStep`):
        ``plan()`` plans it, calling :meth:`prepare_write_data`; the buckets that prepares are
        the write's. :meth:`get_save_function_and_args` then hands out that planning as the
        ``preload_fn`` (``args[1]`` is None until it ran).
        """
        self._job = self._new_job()
        self._deferred = True
        self._plan_step = PlanStep(
            functools.partial(self._run_deferred_plan, plan),
            type(self).preload_tensors,
            f"the DCP save to {self.checkpoint_dir!r}",
        )
        self._payload = None
        self._expected_files = None
        self.written_files = {}

    def _run_deferred_plan(self, plan: Callable[[], None]) -> list[WriteBucket]:
        self._planning = True
        try:
            plan()
        finally:  # the buckets are the planning's to return, never the writer's to hand out
            self._planning = False
            buckets, self._payload = self._payload, None
        if buckets is None:
            raise InvalidRequestError(
                f"the planning of the DCP save to {self.checkpoint_dir!r} prepared no write"
            )
        return buckets

    def _new_job(self) -> WriteJob:
        return WriteJob(
            checkpoint_dir=self.checkpoint_dir,
            use_msc=self.use_msc,
            rank=self._rank(),
            token=uuid.uuid4().hex,
            sync_files=self.sync_files,
            thread_count=self.thread_count,
            transforms=getattr(self, "transforms", None),
            retry=self.retry_policy,
            open_file=None if self.open_file is open else self.open_file,
            multiproc_io=self.is_multiproc_io,
            align_items=self.align_items,
        )

    def get_save_function_and_args(self) -> tuple[Any, Any, list]:
        """``(save_fn, preload_fn, args)``, or ``(None, None, [])`` when this rank writes nothing.
        ``preload_fn()`` returns the buckets with tensors on the host, to replace ``args[1]``; a
        deferred save's is its planning (a :class:`._staging.PlanStep`), and its ``args[1]`` is
        None until that ran.

        The payload (which references the trainer's tensors) is handed over, not kept, so once the
        request is staged the writer holds no training memory. A second call for the same prepared
        save raises ``FrozenRequestError``.
        """
        if self._job is None or not self.has_data_to_write:
            return None, None, []
        save_fn = functools.partial(type(self).write_preloaded_data_multithread, self._job)
        if self._deferred:
            step, self._plan_step = self._plan_step, None
            if step is not None:
                return save_fn, step, [self._job.rank, None]
        elif self._payload is not None:
            buckets, self._payload = self._payload, None
            preload_fn = functools.partial(type(self).preload_tensors, buckets, True)
            return save_fn, preload_fn, [self._job.rank, buckets]
        raise FrozenRequestError(
            f"the write payload of this save to {self.checkpoint_dir!r} has already been "
            "transferred (get_save_function_and_args was called before); call "
            "prepare_write_data (or plan again) to prepare another save"
        )

    @staticmethod
    def preload_tensors(
        write_buckets: list[WriteBucket], non_blocking: bool = True
    ) -> list[WriteBucket]:
        """The buckets with every tensor on the host and none aliasing memory another process can
        change: device tensors are copied, and CPU tensors in shared memory (``share_memory_()``)
        are cloned, since the trainer may still write them; private CPU tensors pass as they are.
        """
        return host_buckets(write_buckets, non_blocking)

    # -- the background write ---------------------------------------------------------------

    @classmethod
    def write_preloaded_data_multithread(
        cls, job: WriteJob, rank: int, write_buckets: list[WriteBucket]
    ) -> None:
        """Background entry point: write every bucket with ``job.thread_count`` threads
        (``write_buckets`` may also be the payload itself, called without ``preload_fn``)."""
        buckets = buckets_of(write_buckets)
        run_write_job(job, buckets, functools.partial(cls.write_preloaded_data, job))

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

    # -- finalize (trainer): the results, the commit record ------------------------------------

    def _commit(self) -> RecordCommit:
        return RecordCommit(self._backend, self.checkpoint_dir, sync=self.sync_files)

    def retrieve_write_results(self) -> list[WriteResult]:
        """This rank's write results; raises ``CheckpointWriteError`` if the write failed."""
        return [result for rows in self.retrieve_write_rows() for result in decode_results(rows)]

    def retrieve_write_rows(self) -> list[bytes]:
        """This rank's write results as the background write encoded them, one ``bytes`` per
        data file (what the finalize gathers, for the coordinator alone to decode); raises
        ``CheckpointWriteError`` if the write failed."""
        if self._expected_files is None:
            what = (
                "the deferred planning of this save did not run: its request was not staged"
                if self._deferred
                else "retrieve_write_results before prepare_write_data: nothing was planned"
            )
            raise CheckpointWriteError(what, rank=self._rank())
        # A save function was handed out (the payload is gone) iff a report will come: a
        # deferred save's always, even when its planning gave this rank nothing to write.
        handed_out = self._payload is None and self._plan_step is None
        if self._job is None or not (self._expected_files or handed_out):
            return []
        report = take_report(self._job)
        self.written_files = _checked_files(report, self._expected_files, self.checkpoint_dir)
        return [record.results for record in report.files]

    def finish(
        self,
        metadata: Metadata,
        results: list[list[WriteResult]],
        file_checksums: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        """Write the commit record (coordinator only, after every rank's write succeeded)."""
        _complete_metadata(metadata, results, self.storage_meta())
        if file_checksums is None and len(results) == 1:
            file_checksums = self.written_files or None
        self.publish_metadata(metadata, file_checksums)

    def publish_metadata(
        self, metadata: Metadata, file_checksums: dict[str, tuple[int, int]] | None = None
    ) -> None:
        """Write ``metadata`` atomically as the commit record, with the data files' checksum table
        (coordinator only).
        """
        _attach_file_table(metadata, file_checksums)
        self._commit().commit(lambda f: pickle.dump(metadata, f))
        logger.info("committed checkpoint %s", self.checkpoint_dir)

    def read_metadata(self) -> Metadata:
        """This checkpoint's commit record, unpickled restrictedly (a foreign global is refused,
        never run).
        """
        path = self._commit().record_path
        with self._backend.open_read(path) as f:
            return _restricted_pickle.load(f, path=path, expect=Metadata)  # type: ignore[no-any-return]

    # -- identity -----------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        if checkpoint_id:
            self.checkpoint_dir = _checkpoint_dir_of(checkpoint_id)
            self._backend = get_backend(
                self.checkpoint_dir, use_msc=self.use_msc, retry=self.retry_policy
            )
        self._payload = None
        self._expected_files = None
        self.written_files = {}
        self._job = None
        self._deferred = False
        self._plan_step = None

    @property
    def checkpoint_id(self) -> str | os.PathLike:
        return self.checkpoint_dir

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True
