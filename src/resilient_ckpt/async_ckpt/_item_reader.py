"""Loading the tensors of a DCP checkpoint file that is already in memory, without copies.

torch's ``FileSystemReader.read_data`` reads every item through ``torch.load`` of a file
slice: the archive's bytes are copied into a new storage (a fresh allocation, its pages
faulted in), then copied again into the target tensor. When the whole file is already
mapped (a memory-tier file in ``/dev/shm``, a mapped local file after its checksum pass),
the tensor's bytes can be *viewed* where they lie and copied once, straight into the target.

An item written with ``torch.save`` is a zip archive: a pickle (``data.pkl``) that rebuilds
the tensor from storages, and one stored (uncompressed) record per storage. This module
finds the record in the archive, unpickles ``data.pkl`` with an unpickler that knows only
the handful of names a saved tensor needs (anything else falls back to ``torch.load`` with
``weights_only=True``, so nothing is executed that torch's own safe loader would refuse),
and returns a tensor viewing the record. Our writer starts every tensor item on a 64-byte
boundary when asked to (the tiered manager does; torch aligns records to 64 bytes inside
the archive), so the view is aligned for every dtype; a record that is not aligned (torch's
writer, or ours with byte-identical output) is copied once into aligned memory first.
"""

from __future__ import annotations

import collections
import functools
import io
import mmap
import os
import pickle
import struct
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .._torch_compat import storage_type_dtypes
from ..errors import CorruptCheckpointError

__all__ = ["ITEM_ALIGNMENT", "byte_view", "item_tensor", "map_file", "read_items"]

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
    """Each stored record of a zip archive: its name (less the archive's top folder) ->
    (offset of its data, size). Raises ``_Unsupported`` for anything but stored records in
    a zip32 archive without a comment (what ``torch.save`` writes below 4 GiB)."""
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
    """Unpickles ``data.pkl`` of a saved tensor into a :class:`_Record`; knows nothing else.

    What ``find_class`` returns lands in the unpickler's memo, so it must not refer back to
    the unpickler: a cycle would keep the archive's memory (a file mapping) alive until the
    cyclic garbage collector ran, pinning the file's pages in the page cache."""

    def __init__(self, data: bytes, records: Callable[[_StorageRef], torch.Tensor]) -> None:
        super().__init__(io.BytesIO(data))
        self._rebuild = functools.partial(_rebuild, records)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
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
    """``torch._utils._rebuild_tensor_v2``'s arguments -> where the tensor lies."""
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
    """The record of the tensor ``torch.save`` wrote in ``item`` (a uint8 tensor holding the
    whole archive), or None when the archive is not one this module reads."""
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
    """What ``torch.save`` wrote in ``item``: a tensor viewing ``item``'s memory when the
    archive is a plain saved tensor with an aligned record, otherwise ``torch.load``'s
    (``weights_only``) result."""
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
) -> Future[None]:
    """``StorageReader.read_data`` over whole files in memory: ``file_bytes(relative_path)``
    returns a file's bytes as a uint8 CPU tensor (mapped or read, verified by the caller).
    Items with stream transforms are not handled here (the caller uses torch's reader)."""
    per_file: dict[str, list[ReadItem]] = {}
    for read_item in plan.items:
        per_file.setdefault(storage_data[read_item.storage_index].relative_path, []).append(
            read_item
        )
    for relative_path, reqs in per_file.items():
        data = file_bytes(relative_path)
        for req in sorted(reqs, key=lambda r: storage_data[r.storage_index].offset):
            info = storage_data[req.storage_index]
            if info.offset + info.length > data.numel():
                raise CorruptCheckpointError(
                    f"{relative_path}: item {req.storage_index} ends at byte "
                    f"{info.offset + info.length}, after the end of the file ({data.numel()})",
                    path=relative_path,
                )
            piece = data[info.offset : info.offset + info.length]
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(byte_view(piece).tobytes()))
                continue
            target = planner.resolve_tensor(req).detach()
            _copy_item(piece, req, target, relative_path)
            planner.commit_tensor(req, target)
    done: Future[None] = Future()
    done.set_result(None)
    return done


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
    """The chunk of ``tensor`` a read request names, as torch's readers narrow it: a view,
    narrowed only along the dimensions the chunk does not span whole."""
    for dim, (offset, size) in enumerate(zip(offsets, sizes, strict=False)):
        if size < tensor.size(dim):
            tensor = tensor.narrow(dim, offset, size)
    return tensor


def map_file(path: str) -> torch.Tensor:
    """The bytes of a local file as a uint8 tensor over a private mapping (read into memory
    where the file cannot be mapped). Pages are read when an item touches them, so a load
    that needs part of a file (resharding) reads only that part. Committed checkpoint files
    are never rewritten in place, so the mapping keeps the bytes it was opened on."""
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
