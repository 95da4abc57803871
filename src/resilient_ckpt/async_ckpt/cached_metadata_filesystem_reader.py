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

**Data items from a mapped file** (:func:`read_items`, also used by the tiered restore). torch's
reader loads each item's slice with ``torch.load`` into a fresh storage, then copies it into the
target. With the whole file mapped, the tensor's record in the item's zip archive is *viewed*
where it lies and copied once into the target. ``data.pkl`` is unpickled with an unpickler that
knows only the names a saved tensor needs; anything else falls back to
``torch.load(weights_only=True)``, so nothing runs that torch's safe loader would refuse. A
record not aligned for its dtype is copied once into aligned memory first; items with stream
transforms go through torch's reader.
"""

from __future__ import annotations

import collections
import copy
import functools
import io
import mmap
import os
import pickle
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .. import _restricted_pickle
from .._torch_compat import REBUILD_TENSOR, has_stream_transforms, storage_type_dtypes
from ..errors import CorruptCheckpointError, NoCheckpointError
from ..storage.base import get_backend, is_msc_url
from ..storage.commit import COMMIT_RECORD
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


# -- data items from a file in memory --------------------------------------------------------

ITEM_ALIGNMENT = 64  # bytes; what torch aligns records to inside an archive

# Zip records (APPNOTE.TXT): the end of central directory, a central directory entry and a
# local file header, each read only for the fields used here.
_EOCD = struct.Struct("<4s6xHII2x")  # signature, entries, directory size, directory offset
_CENTRAL = struct.Struct("<4s6xH12xIHHH8xI")  # sig, method, size, name/extra/comment, offset
_LOCAL = struct.Struct("<4s22xHH")  # signature, file name length, extra field length
_ZIP64_MARK = 0xFFFFFFFF

# "FloatStorage" -> torch.float32, ...: the names torch.save writes for a storage's dtype.
_STORAGE_DTYPES = storage_type_dtypes()


class _Unsupported(Exception):
    """The archive is not the plain layout this module reads; ``torch.load`` it instead."""


def _entries(view: memoryview) -> dict[str, tuple[int, int]]:
    """Each stored record of a zip archive: name (less the top folder) -> (data offset, size).
    Raises ``_Unsupported`` for anything but stored records of a zip32 archive, which is what
    ``torch.save`` writes below 4 GiB.
    """
    end = len(view) - _EOCD.size
    if end < 0:
        raise _Unsupported("too short for a zip archive")
    signature, count, size, offset = _EOCD.unpack(view[end:])
    if signature != b"PK\x05\x06" or _ZIP64_MARK in (size, offset) or offset + size > end:
        raise _Unsupported("no plain end of central directory")
    found: dict[str, tuple[int, int]] = {}
    pos = offset
    for _ in range(count):
        sig, method, nbytes, name_len, extra_len, comment_len, local = _CENTRAL.unpack(
            view[pos : pos + _CENTRAL.size]
        )
        if sig != b"PK\x01\x02" or method != 0 or _ZIP64_MARK in (nbytes, local):
            raise _Unsupported("a compressed, zip64 or damaged record")
        name = bytes(view[pos + _CENTRAL.size : pos + _CENTRAL.size + name_len]).decode()
        pos += _CENTRAL.size + name_len + extra_len + comment_len
        head, local_name_len, local_extra_len = _LOCAL.unpack(view[local : local + _LOCAL.size])
        if head != b"PK\x03\x04":
            raise _Unsupported("no local file header")
        start = local + _LOCAL.size + local_name_len + local_extra_len
        if start + nbytes > offset:
            raise _Unsupported(f"record {name} runs past the records")
        found[name.split("/", 1)[-1]] = (start, nbytes)
    return found


class _Record:
    """Where a saved tensor lies in an archive: its storage's bytes and the view of them."""

    def __init__(self, raw: torch.Tensor, dtype: torch.dtype) -> None:
        self.raw, self.dtype = raw, dtype
        self.offset = 0
        self.size: tuple[int, ...] = ()
        self.stride: tuple[int, ...] = ()

    def whole_and_contiguous(self) -> bool:
        """True when the tensor is its storage's bytes in row-major order."""
        expected = 1
        for size, stride in zip(reversed(self.size), reversed(self.stride), strict=True):
            if size > 1 and stride != expected:
                return False
            expected *= size
        return self.offset == 0 and expected * self.dtype.itemsize == self.raw.numel()

    def tensor(self) -> torch.Tensor:
        raw, itemsize = self.raw, self.dtype.itemsize
        if raw.numel() == 0:
            return torch.empty_strided(self.size, self.stride, dtype=self.dtype)
        if raw.data_ptr() % itemsize or raw.storage_offset() % itemsize:
            raw = raw.clone()  # one aligned copy (a record another writer did not pad)
        typed = raw.view(self.dtype)
        return torch.as_strided(typed, self.size, self.stride, typed.storage_offset() + self.offset)


class _StorageRef:
    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorUnpickler(pickle.Unpickler):
    """Unpickles a saved tensor's ``data.pkl`` into a :class:`_Record`; knows nothing else.

    What ``find_class`` returns lands in the memo, so it must not refer back to the unpickler:
    the cycle would keep the file mapping, and its page-cache pages, alive until a GC pass.
    """

    def __init__(self, data: bytes, records: Callable[[_StorageRef], torch.Tensor]) -> None:
        super().__init__(io.BytesIO(data))
        self._rebuild = functools.partial(_rebuild, records)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == REBUILD_TENSOR:
            return self._rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise _Unsupported(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise _Unsupported(f"persistent id {pid!r}")
        _, dtype, key, _location, numel = pid
        if not isinstance(dtype, torch.dtype):
            raise _Unsupported(f"storage type {dtype!r}")
        return _StorageRef(str(key), dtype, int(numel))


def _rebuild(
    records: Callable[[_StorageRef], torch.Tensor],
    storage: Any,
    offset: int,
    size: Sequence[int],
    stride: Sequence[int],
    requires_grad: bool = False,
    hooks: Any = None,
    metadata: Any = None,
) -> _Record:
    """``REBUILD_TENSOR``'s arguments -> where the tensor lies."""
    if not isinstance(storage, _StorageRef) or hooks or metadata:
        raise _Unsupported("a tensor with hooks or metadata")
    record = _Record(records(storage), storage.dtype)
    record.offset, record.size, record.stride = int(offset), tuple(size), tuple(stride)
    return record


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A memoryview of a contiguous uint8 CPU tensor's bytes (no copy)."""
    array: Any = tensor.numpy()
    return memoryview(array)


def _locate(item: torch.Tensor) -> _Record | None:
    """The record of the tensor saved in ``item`` (the whole archive as uint8), or None when the
    archive is not one this module reads.
    """
    view = byte_view(item)
    try:
        entries = _entries(view)
        if "byteorder" in entries:
            start, nbytes = entries["byteorder"]
            if bytes(view[start : start + nbytes]) != b"little":
                return None

        def storage(ref: _StorageRef) -> torch.Tensor:
            start, nbytes = entries[f"data/{ref.key}"]
            if nbytes != ref.numel * ref.dtype.itemsize:
                raise _Unsupported(f"record data/{ref.key} has {nbytes} bytes")
            return item[start : start + nbytes]

        start, nbytes = entries["data.pkl"]
        record = _TensorUnpickler(bytes(view[start : start + nbytes]), storage).load()
    except (_Unsupported, KeyError, ValueError, struct.error, pickle.UnpicklingError):
        return None
    return record if isinstance(record, _Record) else None


def item_tensor(item: torch.Tensor) -> Any:
    """What ``torch.save`` wrote in ``item``: a view of its memory for a plain saved tensor, else
    ``torch.load(weights_only=True)``'s result.
    """
    record = _locate(item)
    if record is not None:
        return record.tensor()
    stream = io.BytesIO(byte_view(item).tobytes())
    return torch.load(stream, map_location="cpu", weights_only=True)


def read_items(
    plan: LoadPlan,
    planner: LoadPlanner,
    storage_data: dict[Any, Any],
    file_bytes: Callable[[str], torch.Tensor],
    on_read: Callable[[int], None] | None = None,
) -> Future[None]:
    """``StorageReader.read_data`` over whole files in memory. ``file_bytes(relative_path)`` gives
    a file's bytes as a uint8 CPU tensor; ``on_read`` is told each item's length. Items with
    stream transforms are the caller's (torch's reader).
    """
    per_file: dict[str, list[ReadItem]] = {}
    for read_item in plan.items:
        per_file.setdefault(storage_data[read_item.storage_index].relative_path, []).append(
            read_item
        )
    for relative_path, reqs in per_file.items():
        data = file_bytes(relative_path)
        for req in sorted(reqs, key=lambda r: storage_data[r.storage_index].offset):
            piece = item_piece(data, storage_data[req.storage_index], relative_path)
            if on_read is not None:
                on_read(piece.numel())
            load_item(req, piece, planner, relative_path)
    done: Future[None] = Future()
    done.set_result(None)
    return done


def item_piece(data: torch.Tensor, info: Any, relative_path: str) -> torch.Tensor:
    """The stored bytes of one item within ``data``, its file's bytes."""
    end = info.offset + info.length
    if end > data.numel():
        raise CorruptCheckpointError(
            f"{relative_path}: an item ends at byte {end}, after the end of the file "
            f"({data.numel()})",
            path=relative_path,
        )
    return data[info.offset : end]


def load_item(
    req: ReadItem,
    piece: torch.Tensor,
    planner: LoadPlanner,
    where: str,
    target: torch.Tensor | None = None,
) -> None:
    """Hand one item's stored bytes to the planner: a bytes item as a stream, a tensor copied once
    into ``target`` (or ``planner.resolve_tensor``'s). ``where`` names the source in errors.
    """
    if req.type == LoadItemType.BYTE_IO:
        planner.load_bytes(req, io.BytesIO(byte_view(piece).tobytes()))
        return
    if target is None:
        target = planner.resolve_tensor(req).detach()
    _copy_item(piece, req, target, where)
    planner.commit_tensor(req, target)


def _copy_item(piece: torch.Tensor, req: ReadItem, target: torch.Tensor, where: str) -> None:
    record = _locate(piece)
    if (
        record is not None
        and record.whole_and_contiguous()
        and tuple(req.lengths) == record.size
        and not any(req.storage_offsets)
        and target.dtype == record.dtype
        and target.size() == record.size
        and target.is_contiguous()
    ):
        # The usual case (same layout as saved): one byte copy, whatever the alignment.
        if target.numel():
            target.reshape(-1).view(torch.uint8).copy_(record.raw)
        return
    saved = record.tensor() if record is not None else item_tensor(piece)
    tensor = _narrow(saved, req.storage_offsets, req.lengths)
    if target.size() != tensor.size():
        raise CorruptCheckpointError(
            f"{where}: item {req.storage_index} has size {tuple(tensor.size())}, "
            f"the state dict expects {tuple(target.size())}",
            path=where,
        )
    target.copy_(tensor)


def _narrow(tensor: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """The chunk a read request names, narrowed as torch's readers narrow it (a view)."""
    for dim, (offset, size) in enumerate(zip(offsets, sizes, strict=False)):
        if size < tensor.size(dim):
            tensor = tensor.narrow(dim, offset, size)
    return tensor


def map_file(path: str) -> torch.Tensor:
    """A local file's bytes as a uint8 tensor over a private mapping (read into memory where it
    cannot be mapped). Pages are read on touch, so a resharding load reads only what it needs;
    committed files are never rewritten in place, so the mapping keeps its bytes.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return torch.empty(0, dtype=torch.uint8)
        try:
            mapping = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        except (OSError, ValueError):
            data = bytearray(f.read())
            return torch.frombuffer(data, dtype=torch.uint8)
    if hasattr(mmap, "MADV_WILLNEED"):
        try:  # start reading the whole file ahead, in large requests
            mapping.madvise(mmap.MADV_WILLNEED)
        except OSError:
            pass  # advice only
    return torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive


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
