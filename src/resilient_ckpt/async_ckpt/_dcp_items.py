"""A DCP data item as it lies in its file, read in place: what the writer and the readers
agree on.

Each item of a DCP data file is one ``torch.save`` zip archive. The writer
(:mod:`._dcp_write`) starts each tensor item at a multiple of :data:`ITEM_ALIGNMENT`, so
that, with the archive's own alignment of its records, a saved tensor's bytes lie aligned
in the file. The readers (the cached reader and the read-once load) hand this module a
file's bytes and take each item from them.

**Viewed where it lies, copied once.** torch's reader loads each item's slice with
``torch.load`` into a fresh storage, then copies it into the target. Here the file is
mapped (:func:`map_file`) and the tensor's record in the item's archive is *viewed* where it
lies and copied once into the target (:func:`load_item`; :func:`read_items` for a whole load
plan, also used by the tiered restore). ``data.pkl`` is unpickled with an unpickler that
knows only the names a saved tensor needs; anything else falls back to
``torch.load(weights_only=True)``, so nothing runs that torch's safe loader would refuse. A
record not aligned for its dtype (another writer's file) is copied once into aligned memory
first. Items with stream transforms are the caller's (torch's reader).

A module of its own, below the writer and both readers, so that the writer does not import
a reader for the alignment and the read-once load does not import the reader built on it.
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

from .._torch_compat import REBUILD_TENSOR, storage_type_dtypes
from ..errors import CorruptCheckpointError

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
