"""``CachedMetadataFileSystemReader``: a DCP ``FileSystemReader`` that reads ``.metadata`` once.

Loading a sharded checkpoint reads and unpickles ``.metadata`` on every rank, often several
times (one reader per sub-state). NVRx caches it per directory path, which serves stale
metadata when a directory is rewritten (a new save into the same path). Here the cache key
is the path plus the identity of the metadata file (device, inode, size, modification time
in ns), taken with ``fstat`` on the very file descriptor that is read, so the cached content
always belongs to its key. A rewrite by rename (as every DCP writer commits) changes the
inode, so the next read misses. One ``stat`` per read is the price.

The cache is process-wide, bounded (least recently used entries are dropped) and
thread-safe. Each reader gets its own shallow copy whose ``storage_meta.load_id`` is its own,
as the uncached reader would set it.

Object stores. An ``msc://<profile>/<path>`` checkpoint is read through the storage backend
(:class:`~resilient_ckpt.storage.dcp_fs.BackendFileSystem`, with the backend's retries and
parallel read-ahead of the data files); the metadata's identity is the object's size, ETag
and modification time, taken before it is downloaded: a rewrite in between makes this read
return the newer content and the next one miss, never a stale hit.
"""

from __future__ import annotations

import copy
import os
import pickle
import threading
from collections import OrderedDict
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from .._torch_compat import has_stream_transforms
from ..storage.base import is_msc_url
from ..storage.commit import COMMIT_RECORD
from ..storage.factory import get_backend
from ._item_reader import map_file, read_items

__all__ = ["CachedMetadataFileSystemReader", "clear_metadata_cache"]

_MAX_ENTRIES = 64

_Key = tuple[Any, ...]


def _cache_dir(path: str | os.PathLike) -> str:
    if is_msc_url(path):
        return str(path).rstrip("/")
    return os.path.abspath(os.fspath(path))


class CachedMetadataFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` is cached process-wide (see module doc).

    Args:
        path: checkpoint directory, or ``msc://<profile>/<path>``.
        cache_metadata: False reads the file every time (the plain reader's behaviour).
        thread_count: for object stores, how many data files are downloaded in parallel
            ahead of their use (POSIX reads are torch's, unchanged).
    """

    _metadata_cache: OrderedDict[_Key, Metadata] = OrderedDict()
    _lock = threading.Lock()

    def __init__(
        self, path: str | os.PathLike, cache_metadata: bool = True, *, thread_count: int = 4
    ) -> None:
        super().__init__(path=path)
        self._cache_dir = _cache_dir(path) if cache_metadata else None
        self.thread_count = thread_count
        self._object_store: Any = None
        if is_msc_url(path):
            from ..storage.dcp_fs import BackendFileSystem

            self._object_store = get_backend(str(path))
            self._backend_fs = BackendFileSystem(self._object_store)
            self.fs = self._backend_fs  # type: ignore[assignment]  # torch's FileSystemBase
            self.path = str(path)  # type: ignore[assignment]

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        if checkpoint_id and self._cache_dir is not None:
            self._cache_dir = _cache_dir(checkpoint_id)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._object_store is None:
            if has_stream_transforms(self.storage_data, plan.items):
                return super().read_data(plan, planner)
            # Files mapped, each tensor copied once from the page cache into its target
            # (torch's reader copies each item into a fresh storage first).
            root = os.fspath(self.path)
            return read_items(
                plan, planner, self.storage_data, lambda name: map_file(os.path.join(root, name))
            )
        names = dict.fromkeys(self.storage_data[i.storage_index].relative_path for i in plan.items)
        paths = [self._backend_fs.concat_path(self.path, name) for name in names]
        self._backend_fs.read_ahead(paths, self.thread_count)
        try:
            return super().read_data(plan, planner)
        finally:
            self._backend_fs.stop_read_ahead()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._cache_dir is None:
            return super().read_metadata(*args, **kwargs)
        rank = kwargs.get("rank")
        name = COMMIT_RECORD if rank is None else f"__{rank}{COMMIT_RECORD}"
        if self._object_store is not None:
            return self._read_object_metadata(self._cache_dir, rank, name)
        with open(os.path.join(self._cache_dir, name), "rb") as f:
            st = os.fstat(f.fileno())
            key: _Key = (self._cache_dir, rank, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            metadata = self._lookup(key)
            if metadata is None:
                metadata = pickle.load(f)
                self._store(key, metadata)
        return self._for_this_reader(metadata)

    def _read_object_metadata(self, directory: str, rank: Any, name: str) -> Metadata:
        path = self._object_store.join(directory, name)
        key: _Key = (directory, rank, *self._object_store.version(path))
        metadata = self._lookup(key)
        if metadata is None:
            with self._object_store.open_read(path) as f:
                metadata = pickle.load(f)
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
