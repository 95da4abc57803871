"""``LocalCheckpointManager``: local checkpoints in per-rank directories of a file system.

Layout (file names: :mod:`resilient_ckpt.local._manifest`)::

    <root_local_ckpt_dir>/<session_id>/<rank>/iter_<iteration:07d>_<owner>_local.pt
                                              iter_<iteration:07d>_<owner>_local.manifest.json

Commit, per copy: the worker writes and fsyncs ``...local.dirty.pt``, then the manifest
atomically; after every rank succeeded the trainer renames the dirty file and fsyncs the
directory. The rename is the commit: a copy without its final name does not exist for
readers. ``sync_files=False`` skips the fsyncs (not crash-durable).

NVRx's files in the same layout (no manifest) are read too, so a job that switches keeps its
progress (:mod:`resilient_ckpt.local._nvrx_format`). Retention keeps the newest
``keep_latest`` committed iterations (default 1, as NVRx), deleting older ones only after a
newer one is committed.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..._logging import get_logger
from ...errors import ConfigurationError, CorruptCheckpointError
from ...storage.commit import RenameCommit
from ...storage.posix import PosixBackend, probe_writable
from .. import _deleter, _nvrx_format
from .._format import read_verified
from .._manifest import (
    DATA,
    DIRTY,
    MANIFEST,
    STATUS,
    CopyInfo,
    Manifest,
    file_name,
    is_temp_name,
    parse_name,
)
from .._writer import CopyTarget, write_copies
from ..replication.strategies import ReplicationStrategy
from .base_manager import BaseCheckpointManager, CkptID

logger = get_logger(__name__)

__all__ = ["LocalCheckpointManager"]


def _file_iteration(name: str) -> int | None:
    """The iteration a copy file or its temporary belongs to."""
    if is_temp_name(name):
        name = name[1:].split(".tmp-", 1)[0]
    parsed = parse_name(name)
    return parsed[0] if parsed is not None else None


class LocalCheckpointManager(BaseCheckpointManager):
    """Local checkpoints on node-local storage (SSD, RAM disk), NVRx-compatible.

    Implements the storage hooks of :class:`~.base_manager.BaseCheckpointManager`, whose
    collective ``save``, ``warmup``, ``find_latest`` and ``load`` it inherits.

    Args:
        root_local_ckpt_dir: root directory; each rank uses ``<root>/<session_id>/<rank>``.
        session_id: separates the checkpoints of different jobs under one root.
        repl_strategy: replication strategy (e.g. ``CliqueReplicationStrategy``); None keeps
            only each rank's own copy.
        keep_latest: how many committed iterations to keep (default 1).
        sync_files: fsync data, manifests and directories (default True).
        defer_planning: an async save without ``repl_strategy`` checks its request and lays
            the shard out (agreed across ranks) when its request is staged, not in ``save``
            (with ``overlap_staging=True``, on the staging thread); its errors are raised on
            every rank by ``schedule_async_request`` or ``wait_for_snapshot``. Default False.
        weights_only: the safe mode of ``load`` (see
            :class:`~.base_manager.BaseCheckpointManager`). Default False: unpickled freely,
            as NVRx does.
    """

    def __init__(
        self,
        root_local_ckpt_dir: str | os.PathLike[str],
        session_id: str = "",
        repl_strategy: ReplicationStrategy | None = None,
        *,
        keep_latest: int = 1,
        sync_files: bool = True,
        defer_planning: bool = False,
        weights_only: bool = False,
    ) -> None:
        if not isinstance(session_id, str) or os.sep in session_id or session_id in (".", ".."):
            raise ConfigurationError(
                f"session_id must be a string usable as one directory name, got {session_id!r}"
            )
        if not isinstance(keep_latest, int) or isinstance(keep_latest, bool) or keep_latest < 1:
            raise ConfigurationError(f"keep_latest must be an int >= 1, got {keep_latest!r}")
        super().__init__(session_id, repl_strategy, weights_only=weights_only)
        if not isinstance(defer_planning, bool):
            raise ConfigurationError(f"defer_planning must be a bool, got {defer_planning!r}")
        self.defer_planning = defer_planning
        self.root_local_ckpt_dir = root_local_ckpt_dir
        self.keep_latest = keep_latest
        self.sync_files = sync_files
        self._backend = PosixBackend()
        self._probed = False
        self._pending: dict[int, list[int]] = {}

    @property
    def local_ckpt_dir(self) -> Path:
        return Path(self.root_local_ckpt_dir) / self.session_id / str(self.rank)

    def _filename_from_template(
        self, iteration: int | str, rank: int | str, extra_suffix: str = ""
    ) -> str:
        """The name NVRx gives rank ``rank``'s file of ``iteration`` (``extra_suffix`` goes
        before ``.pt``: ``".dirty"`` names the file being written).

        Integers (and digit strings) are padded to seven digits as in every file name here;
        other strings are used as they are, so patterns (``"*"``, ``"\\d+"``) can be built.
        """
        if isinstance(iteration, str) and iteration.isdigit():
            iteration = int(iteration)
        if isinstance(iteration, int) and not isinstance(iteration, bool):
            if iteration < 0:
                raise ConfigurationError(f"iteration must be >= 0, got {iteration}")
            iteration = f"{iteration:07d}"
        return f"iter_{iteration}_{rank}_local{extra_suffix}.pt"

    def _local_ckpt_path_from_id(self, ckpt_id: CkptID, is_dirty: bool = False) -> Path:
        """Where this rank keeps the copy ``ckpt_id`` = (iteration, owner, session_id)."""
        iteration, owner, session_id = ckpt_id
        if session_id != self.session_id:
            raise ConfigurationError(
                f"checkpoint id {ckpt_id!r} belongs to session {session_id!r}, this manager "
                f"to {self.session_id!r}"
            )
        suffix = ".dirty" if is_dirty else ""
        return self.local_ckpt_dir / self._filename_from_template(iteration, owner, suffix)

    def _filename_to_id(self, filename: str) -> CkptID:
        """(iteration, owner, session_id) of a copy file name (NVRx's inverse of the above)."""
        parsed = parse_name(filename)
        if parsed is None:
            raise ConfigurationError(f"{filename!r} is not the name of a local checkpoint file")
        return (parsed[0], parsed[1], self.session_id)

    def _path(self, name: str) -> str:
        return str(self.local_ckpt_dir / name)

    def _names(self) -> list[str]:
        return self._backend.list(str(self.local_ckpt_dir))

    def _remove(self, name: str, why: str) -> None:
        """Hide now, unlink in the background (see :mod:`.._deleter`)."""
        try:
            _deleter.delete(self._path(name))
            logger.info("removing %s (%s)", self._path(name), why)
        except OSError as exc:
            logger.warning("could not remove %s: %s", self._path(name), exc)

    # -- catalogue --------------------------------------------------------------------------

    def _list_copies(self, skip: set[int]) -> list[CopyInfo]:
        kinds: dict[tuple[int, int], set[str]] = defaultdict(set)
        for name in self._names():
            if name.startswith(_deleter.PREFIX):
                _deleter.unlink_later(self._path(name))
                continue
            iteration = _file_iteration(name)
            if iteration is None or iteration in skip:
                continue
            parsed = parse_name(name)
            if parsed is None:
                self._remove(name, "temporary file of an interrupted write")
                continue
            kinds[(parsed[0], parsed[1])].add(parsed[2])
        copies = []
        for (iteration, owner), found in sorted(kinds.items()):
            copy = self._classify(iteration, owner, found)
            if copy is not None:
                copies.append(copy)
        return copies

    def _classify(self, iteration: int, owner: int, found: set[str]) -> CopyInfo | None:
        for kind in (DIRTY, STATUS):
            if kind in found:
                self._remove(file_name(iteration, owner, kind), "left by an interrupted save")
        if MANIFEST in found and DATA not in found:
            self._remove(file_name(iteration, owner, MANIFEST), "manifest of an uncommitted copy")
            return None
        if DATA in found and MANIFEST not in found:
            return self._nvrx_copy(iteration, owner)
        if DATA not in found:
            return None
        try:
            return self._copy_info(iteration, owner)
        except (CorruptCheckpointError, OSError) as exc:
            logger.warning("local checkpoint copy (%d, %d) ignored: %s", iteration, owner, exc)
            return None

    def _copy_info(self, iteration: int, owner: int) -> CopyInfo:
        manifest_path = self._path(file_name(iteration, owner, MANIFEST))
        with self._backend.open_read(manifest_path) as f:
            manifest = Manifest.from_json(f.read(), manifest_path)
        path = self._path(file_name(iteration, owner, DATA))
        expected = (iteration, owner, self.session_id)
        if (manifest.iteration, manifest.owner, manifest.session_id) != expected:
            raise CorruptCheckpointError(
                f"{manifest_path} describes {(manifest.iteration, manifest.owner)} of session "
                f"{manifest.session_id!r}, not {expected}",
                path=manifest_path,
            )
        size = self._backend.size(path)
        if size != manifest.size:
            raise CorruptCheckpointError(
                f"{path} has {size} bytes, its manifest says {manifest.size}", path=path
            )
        return CopyInfo(
            iteration,
            owner,
            self.rank,
            manifest.size,
            manifest.crc32,
            manifest.world_size,
            manifest.replication,
            path,
        )

    def _nvrx_copy(self, iteration: int, owner: int) -> CopyInfo | None:
        """A copy NVRx wrote (no manifest), if the file is one; see ``.._nvrx_format``."""
        path = self._path(file_name(iteration, owner, DATA))
        try:
            if _nvrx_format.is_nvrx_file(path):
                size = self._backend.size(path)
                return CopyInfo(
                    iteration, owner, self.rank, size, -1, self.world_size, None, path, nvrx=True
                )
        except OSError as exc:
            logger.warning("local checkpoint copy %s ignored: %s", path, exc)
            return None
        logger.warning("%s has no manifest and was not written by NVRx: ignored", path)
        return None

    def _read_copy(self, copy: CopyInfo) -> torch.Tensor:
        if copy.nvrx:
            return _nvrx_format.read_verified_nvrx(copy.path)
        return read_verified(copy.path, copy.size, copy.crc32)

    # -- save -------------------------------------------------------------------------------

    def _prepare_save(self, iteration: int) -> None:
        directory = str(self.local_ckpt_dir)
        self._backend.makedirs(directory)
        if not self._probed:
            probe_writable(directory, "local checkpoint directory")
            self._probed = True
        for name in self._names():
            parsed = parse_name(name)
            if parsed is not None and parsed[2] in (DATA, MANIFEST) and parsed[0] >= iteration:
                raise ConfigurationError(
                    f"iteration {iteration} is not newer than the local checkpoint file {name} "
                    f"in {directory}; call find_latest() first (it resumes from the newest "
                    "complete iteration and removes incomplete newer ones), or save into "
                    "another directory or session_id"
                )

    def _write_request(
        self, iteration: int, ckpt_ids: Sequence[CkptID]
    ) -> tuple[Callable[..., None], list[Any]]:
        replication = self._replication_params()
        targets = [
            CopyTarget(
                ckpt_id=(it, owner, session),
                directory=str(self.local_ckpt_dir),
                manifest=Manifest(
                    iteration=it,
                    owner=owner,
                    session_id=self.session_id,
                    size=-1,
                    crc32=-1,
                    world_size=self.world_size,
                    replication=replication,
                ),
                sync=self.sync_files,
            )
            for it, owner, session in ckpt_ids
        ]
        self._pending[iteration] = [owner for _, owner, _ in ckpt_ids]
        return write_copies, targets

    def _status_path(self, iteration: int) -> str:
        return self._path(file_name(iteration, self.rank, STATUS))

    def _commit(self, iteration: int) -> None:
        self._backend.delete(self._status_path(iteration))
        renames = [
            (
                self._path(file_name(iteration, owner, DIRTY)),
                self._path(file_name(iteration, owner, DATA)),
            )
            for owner in self._pending.pop(iteration, [])
        ]
        RenameCommit(str(self.local_ckpt_dir), renames, sync=self.sync_files).commit()

    # -- retention --------------------------------------------------------------------------

    def _files_by_iteration(self) -> dict[int, list[str]]:
        files: dict[int, list[str]] = defaultdict(list)
        for name in self._names():
            iteration = _file_iteration(name)
            if iteration is not None:
                files[iteration].append(name)
        return files

    def _delete_iterations(self, iterations: set[int], why: str) -> None:
        for iteration, names in self._files_by_iteration().items():
            if iteration in iterations:
                for name in names:
                    self._remove(name, why)

    def _cleanup(self, iteration: int) -> None:
        files = self._files_by_iteration()
        committed = sorted(
            it
            for it, names in files.items()
            if any((p := parse_name(n)) is not None and p[2] == DATA for n in names)
        )
        keep = set(committed[-self.keep_latest :]) | {iteration} | self._inflight
        old = {it for it in files if it < iteration and it not in keep}
        self._delete_iterations(old, f"retention keeps the newest {self.keep_latest}")

    def _cleanup_failed_save(self, iteration: int) -> None:
        self._pending.pop(iteration, None)
        self._delete_iterations({iteration}, "failed save")

    def _free_failed_copies(self, iteration: int) -> None:
        for name in self._files_by_iteration().get(iteration, []):
            parsed = parse_name(name)
            if parsed is not None and parsed[2] == DIRTY:
                try:  # unlinked now, not by the deleter: the space is needed at once
                    os.unlink(self._path(name))
                except OSError as exc:
                    logger.warning("could not remove %s: %s", name, exc)

    def _discard(self, iterations: Sequence[int]) -> None:
        self._delete_iterations(set(iterations), "incomplete iteration")
