"""The DCP readers: ``CachedMetadataFileSystemReader`` reads ``.metadata`` once, and loads the
data items of local files from a mapping of the file, copying each tensor once.

**Metadata cached by the file's identity.** Loading reads ``.metadata`` on every rank, often
once per sub-state. NVRx caches it per directory path, which serves stale metadata after a
new save into the same path. Here the key is the path plus the file's device, inode, size
and mtime, taken with ``fstat`` on the very descriptor that is read, so the content always
belongs to its key; a commit by rename changes the inode, so the next read misses. The cache
is process-wide, bounded (LRU) and thread-safe; each reader gets a shallow copy with its own
``storage_meta.load_id``, as the uncached reader would set it.

**Metadata is never run.** ``.metadata`` is a pickle that torch's ``FileSystemReader``
unpickles freely, so a checkpoint from elsewhere could run code on every rank. This reader
(cached or not) uses :mod:`resilient_ckpt._restricted_pickle`, which allows DCP's metadata
classes only. The state's non-tensor values are the planner's business:
:class:`WeightsOnlyLoadPlanner`.

**Object stores.** ``msc://<profile>/<path>`` is read through the storage backend
(:class:`~resilient_ckpt.storage.dcp_fs.BackendFileSystem`: retries, parallel read-ahead).
The metadata's identity (size, ETag, mtime) is taken before the download, so a rewrite in
between yields the newer content and a later miss, never a stale hit.

**Data items from a mapped file.** Local files are mapped and each tensor is copied once from
where it lies into its target (:mod:`._dcp_items`, which the read-once path shares); items
with stream transforms go through torch's reader.
"""

from __future__ import annotations

import copy
import io
import os
import threading
from collections import OrderedDict
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .. import _restricted_pickle
from .._torch_compat import has_stream_transforms
from ..errors import NoCheckpointError
from ..storage import get_backend, is_msc_url
from ..storage.commit import COMMIT_RECORD
from ._dcp_items import map_file, read_items
from ._read_once import ReadOnceReader, bytes_read_by_rank

__all__ = [
    "CachedMetadataFileSystemReader",
    "WeightsOnlyLoadPlanner",
    "bytes_read_by_rank",
    "clear_metadata_cache",
]

_MAX_ENTRIES = 64

_Key = tuple[Any, ...]


def _cache_dir(path: str | os.PathLike) -> str:
    if is_msc_url(path):
        return str(path).rstrip("/")
    return os.path.abspath(os.fspath(path))


class CachedMetadataFileSystemReader(ReadOnceReader, FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` is cached process-wide (see the module note),
    and whose loads read each stored byte once across ranks.

    **Read once.** In a load over every rank of the job, an item that several ranks need is read
    by one of them and carried to the others over the process group (design note:
    :mod:`resilient_ckpt.async_ckpt._read_once`). Results, resharding included, are those of
    torch's reader. A rank that fails to read makes every rank fail (``dcp.load`` raises torch's
    ``CheckpointException`` whose ``failures`` hold
    :class:`~resilient_ckpt.errors.RankCheckpointReadError`), never wait. A load of one process,
    or of a subgroup, reads as torch's reader does.

    Args:
        path: checkpoint directory, or ``msc://<profile>/<path>``.
        cache_metadata: False reads the file every time (the plain reader's behaviour).
        thread_count: for object stores, how many data files are downloaded in parallel
            ahead of their use (local files are mapped).
        read_once: True shares reads across ranks, False has every rank read all it needs
            (torch's behaviour); None (default) follows ``RESILIENT_CKPT_READ_ONCE``
            (default on). The coordinator's setting decides for a load.

    ``bytes_read`` is the data bytes this rank read from storage in its latest load;
    :func:`bytes_read_by_rank` gathers every rank's (collective).
    """

    _metadata_cache: OrderedDict[_Key, Metadata] = OrderedDict()
    _lock = threading.Lock()

    def __init__(
        self,
        path: str | os.PathLike,
        cache_metadata: bool = True,
        *,
        thread_count: int = 4,
        read_once: bool | None = None,
    ) -> None:
        super().__init__(path=path, read_once=read_once)
        self._cache_dir = _cache_dir(path) if cache_metadata else None
        self.thread_count = thread_count
        self._object_store: Any = None
        self._mapped: dict[str, torch.Tensor] = {}
        if is_msc_url(path):
            from ..storage.dcp_fs import BackendFileSystem

            self._object_store = get_backend(str(path))
            self._backend_fs = BackendFileSystem(self._object_store, on_read=self._count_read)
            self.fs = self._backend_fs  # type: ignore[assignment]  # torch's FileSystemBase
            self.path = str(path)  # type: ignore[assignment]

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        if checkpoint_id and self._cache_dir is not None:
            self._cache_dir = _cache_dir(checkpoint_id)

    def _read_alone(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._object_store is None:
            if has_stream_transforms(self.storage_data, plan.items):
                # torch's reader reads each item's byte range
                self._count_read(sum(self.storage_data[i.storage_index].length for i in plan.items))
                return FileSystemReader.read_data(self, plan, planner)
            # Files mapped, each tensor copied once from the page cache into its target
            # (torch's reader copies each item into a fresh storage first).
            root = os.fspath(self.path)
            return read_items(
                plan,
                planner,
                self.storage_data,
                lambda name: map_file(os.path.join(root, name)),
                self._count_read,
            )
        names = dict.fromkeys(self.storage_data[i.storage_index].relative_path for i in plan.items)
        self._begin_reads(list(names))
        try:
            return FileSystemReader.read_data(self, plan, planner)
        finally:
            self._release_files()

    def _whole_files(self) -> bool:
        return self._object_store is not None  # an object is downloaded whole

    def _begin_reads(self, names: list[str]) -> None:
        if self._object_store is not None:
            paths = [self._backend_fs.concat_path(self.path, name) for name in names]
            self._backend_fs.read_ahead(paths, self.thread_count)

    def _file_bytes(self, name: str) -> torch.Tensor:
        if self._object_store is not None:
            return self._backend_fs.read_bytes(self._backend_fs.concat_path(self.path, name))
        if name not in self._mapped:
            self._mapped[name] = map_file(os.path.join(os.fspath(self.path), name))
        return self._mapped[name]

    def _release_files(self) -> None:
        self._mapped.clear()
        if self._object_store is not None:
            self._backend_fs.stop_read_ahead()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's ``.metadata`` (``rank=`` names a rank's own, as torch's reader takes
        it), read with the restricted unpickler: a file naming any global outside DCP's metadata
        raises ``UnsafeCheckpointError`` and is never run; a damaged one raises
        ``CorruptCheckpointError``.
        """
        rank = kwargs.get("rank")
        name = COMMIT_RECORD if rank is None else f"__{rank}{COMMIT_RECORD}"
        try:
            return self._read_commit_record(rank, name)
        except FileNotFoundError as exc:
            if isinstance(exc, NoCheckpointError):
                raise
            raise _no_checkpoint(os.fspath(self.path), name) from exc

    def _read_commit_record(self, rank: Any, name: str) -> Metadata:
        if self._cache_dir is None:
            path = self.fs.concat_path(self.path, name)
            with self.fs.create_stream(path, "rb") as f:
                metadata = _restricted_pickle.load(f, path=str(path), expect=Metadata)
            return self._for_this_reader(metadata)
        if self._object_store is not None:
            return self._read_object_metadata(self._cache_dir, rank, name)
        path = os.path.join(self._cache_dir, name)
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            key: _Key = (self._cache_dir, rank, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            metadata = self._lookup(key)
            if metadata is None:
                metadata = _restricted_pickle.load(f, path=path, expect=Metadata)
                self._store(key, metadata)
        return self._for_this_reader(metadata)

    def _read_object_metadata(self, directory: str, rank: Any, name: str) -> Metadata:
        path = self._object_store.join(directory, name)
        key: _Key = (directory, rank, *self._object_store.version(path))
        metadata = self._lookup(key)
        if metadata is None:
            with self._object_store.open_read(path) as f:
                metadata = _restricted_pickle.load(f, path=path, expect=Metadata)
            self._store(key, metadata)
        return self._for_this_reader(metadata)

    @classmethod
    def _lookup(cls, key: _Key) -> Metadata | None:
        with cls._lock:
            metadata = cls._metadata_cache.get(key)
            if metadata is not None:
                cls._metadata_cache.move_to_end(key)
            return metadata

    @classmethod
    def _store(cls, key: _Key, metadata: Metadata) -> None:
        with cls._lock:
            for stale in [k for k in cls._metadata_cache if k[:2] == key[:2]]:
                del cls._metadata_cache[stale]
            cls._metadata_cache[key] = metadata
            while len(cls._metadata_cache) > _MAX_ENTRIES:
                cls._metadata_cache.popitem(last=False)

    def _for_this_reader(self, metadata: Metadata) -> Metadata:
        mine = copy.copy(metadata)
        storage_meta = copy.copy(metadata.storage_meta) if metadata.storage_meta else StorageMeta()
        storage_meta.load_id = self.load_id
        mine.storage_meta = storage_meta
        return mine

    @classmethod
    def clear_metadata_cache(cls, path: str | os.PathLike | None = None) -> None:
        """Forget cached metadata: of one checkpoint directory, or of all with no ``path``."""
        with cls._lock:
            if path is None:
                cls._metadata_cache.clear()
                return
            directory = _cache_dir(path)
            for key in [k for k in cls._metadata_cache if k[0] == directory]:
                del cls._metadata_cache[key]


def clear_metadata_cache(path: str | os.PathLike | None = None) -> None:
    """Forget cached metadata of ``path`` (or of every directory)."""
    CachedMetadataFileSystemReader.clear_metadata_cache(path)


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads a checkpoint's non-tensor values (a step count, a config)
    with ``torch.load(weights_only=True)``.

    torch's default planner loads them with ``weights_only=False``, so a value pickled by whoever
    wrote the checkpoint runs code on every rank that loads it. Here a value naming a global that
    ``weights_only`` does not allow, nor the user marked safe
    (``torch.serialization.add_safe_globals``), raises
    :class:`~resilient_ckpt.errors.UnsafeCheckpointError` naming the value and the global, and
    nothing runs. A damaged value is a :class:`~resilient_ckpt.errors.CorruptCheckpointError`.
    Tensors load as ever. For a checkpoint of unknown origin::

        dcp.load(
            state_dict,
            storage_reader=CachedMetadataFileSystemReader(path),  # .metadata never run
            planner=WeightsOnlyLoadPlanner(checkpoint=path),
        )

    Args:
        *args, **kwargs: those of ``DefaultLoadPlanner``.
        checkpoint: what errors call the checkpoint (its path, say).
    """

    def __init__(self, *args: Any, checkpoint: str | os.PathLike | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.checkpoint = os.fspath(checkpoint) if checkpoint is not None else "checkpoint"

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        loaded = _restricted_pickle.torch_load(
            value,
            path=f"{self.checkpoint}: value {fqn!r}",
            trust_advice="load it with torch's DefaultLoadPlanner (weights_only=False)",
        )
        if not self.flatten_state_dict:
            self.state_dict[fqn] = loaded
            return
        # The path of the value in the caller's nested state dict, whose containers all
        # exist: the planner flattened that very state dict into these mappings.
        *parents, last = self.mappings[fqn]
        node: Any = self.original_state_dict
        for key in parents:
            node = node[key]
        node[last] = loaded


def _no_checkpoint(path: str, name: str) -> NoCheckpointError:
    """The error of a load pointed at a directory without the commit record ``name``."""
    what = (
        f"no {name} (its commit record) in it"
        if name == COMMIT_RECORD
        else f"neither {COMMIT_RECORD} nor this rank's {name} in it"
    )
    hint = (
        "An empty directory, a save that never committed, or the wrong path: "
        f"`resilient-ckpt ls {path}` lists what is there"
    )
    if "://" not in path and not os.path.isdir(path):
        what, hint = "the directory does not exist", "Check the path"
    return NoCheckpointError(f"{path} holds no DCP checkpoint: {what}. {hint}", path=path)
