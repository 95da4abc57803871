"""The byte format of one local checkpoint shard, and verified reading and writing of it.

A shard is one flat byte string, the same in memory (the buffer exchanged with replication
peers), in a file, and in transit::

    offset 0   magic b"RCLOCAL\\0", u32 format version, u32 reserved, u64 header length
    offset 24  header: pickle of (hollow TensorAwareStateDict, tensor records)
    aligned    tensor data, each tensor's bytes at a 64-byte aligned offset, zero padding

Decisions:

* The hollow state is pickled once and the tensor bytes follow raw, so saving is one copy
  per tensor (into the exchange buffer, or straight from the tensors to the file) and
  loading is one buffer (a mapping of the file, see :mod:`._verified_read`), the tensors being
  *views* of it (64-byte alignment makes every dtype view legal). ``torch.save`` would
  copy each tensor into a zip container and allocate each tensor again on load.
* Integrity is a CRC-32 of the whole byte string (zlib's, computed by the fastest
  implementation installed, see :mod:`._checksum`): enough to catch torn writes and
  flipped bits; this is not an adversarial setting. It is computed in a helper thread while
  the bytes are written, so it costs little wall time: both the CRC and the file I/O
  release the GIL.
* What repeats from save to save in a header (the records, the parts of the state holding
  only tensors) is pickled once and nested as ``pickle.loads(payload)`` (see
  :mod:`._shard_cache`): the header stays one ordinary pickle.
* Loading unpickles the hollow object, like ``torch.load(weights_only=False)``: local
  checkpoints are written by the job itself and are trusted. The managers' safe mode
  (``weights_only=True``) unpickles it with an allow-list instead (see :func:`_header`).
"""

from __future__ import annotations

import io
import pickle
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import torch

from .. import _restricted_pickle
from .._checksum import CrcPipe, crc32
from ..async_ckpt._staging import StagingPart, StagingSource
from ..errors import CheckpointingException, CorruptCheckpointError
from . import _nvrx_format
from ._verified_read import (  # re-exported: verified reading lives in ._verified_read
    check_against_manifest as check_against_manifest,
)
from ._verified_read import read_verified as read_verified
from ._whole import WholeObject
from .base_state_dict import TensorAwareStateDict
from .basic_state_dict import BasicTensorAwareStateDict, TensorPlaceholder

MAGIC = b"RCLOCAL\x00"
FORMAT_VERSION = 1
ALIGN = 64
CHUNK = 16 << 20  # write granularity: the CRC of one chunk overlaps the write of the next
_PREFIX = struct.Struct("<8sIIQ")


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor's bytes are in the shard (offset relative to the data section)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    requires_grad: bool = False
    is_param: bool = False


def header_of(body: bytes) -> bytes:
    """The shard's bytes before its data: the fixed prefix and the pickled ``body``."""
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(body)) + body


@dataclass
class ShardLayout(StagingSource):
    """A shard ready to be written: its header bytes and the tensors, in order, each at its
    offset in the data section (made by :func:`._shard_cache.plan_shard`). ``plan``: the
    generation of the plan cache entry it was made from, if any (the tensors are then
    described as at every save of that generation).

    An async save stages it as explicit data: the tensors, and the rest to rebuild it."""

    header: bytes
    tensors: list[torch.Tensor]
    offsets: list[int]
    data_bytes: int
    plan: int | None = None

    def staging_part(self) -> StagingPart:
        return StagingPart(
            _rebuild_layout,
            (self.header, self.offsets, self.data_bytes),
            self.tensors,
            self.plan,
            self.plan is not None,
        )

    @property
    def data_start(self) -> int:
        return align(len(self.header))

    @property
    def size(self) -> int:
        return self.data_start + self.data_bytes


def _rebuild_layout(
    header: bytes, offsets: list[int], data_bytes: int, tensors: list[torch.Tensor]
) -> ShardLayout:
    return ShardLayout(header, tensors, offsets, data_bytes)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values as a flat uint8 tensor on its device (a copy if non-contiguous,
    or if a lazy conjugate or negative bit must be applied first: the values are stored)."""
    flat = tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return flat.view(torch.uint8)


def _pieces(layout: ShardLayout) -> Iterator[tuple[int, torch.Tensor | bytes]]:
    """(absolute offset, bytes) of the header and of every tensor, in file order."""
    yield 0, layout.header
    start = layout.data_start
    for offset, tensor in zip(layout.offsets, layout.tensors, strict=True):
        if tensor.numel():
            yield start + offset, _as_bytes(tensor)


def write_into(layout: ShardLayout, out: torch.Tensor) -> None:
    """Copy the shard into ``out`` (a CPU uint8 tensor of at least ``layout.size`` bytes)."""
    position = 0
    with torch.no_grad():
        for offset, piece in _pieces(layout):
            out[position:offset].zero_()
            if isinstance(piece, bytes):
                _bytes_view(out)[offset : offset + len(piece)] = piece
                position = offset + len(piece)
            else:
                out[offset : offset + piece.numel()].copy_(piece)
                position = offset + piece.numel()
        out[position : layout.size].zero_()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def serialize(layout: ShardLayout) -> torch.Tensor:
    """The shard as one new CPU uint8 tensor."""
    out = torch.empty(layout.size, dtype=torch.uint8)
    write_into(layout, out)
    return out


def bytes_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU uint8 tensor (no copy)."""
    array: Any = tensor.numpy()
    return memoryview(array).cast("B")


_bytes_view = bytes_view


def _host_view(piece: torch.Tensor | bytes) -> memoryview:
    if isinstance(piece, bytes):
        return memoryview(piece)
    return _bytes_view(piece.cpu())


def _chunks(view: memoryview, size: int = CHUNK) -> Iterator[memoryview]:
    for start in range(0, len(view), size):
        yield view[start : start + size]


def stream_to(f: IO[bytes], source: ShardLayout | ShardBuffer | torch.Tensor) -> tuple[int, int]:
    """Write a shard (a layout, or a ready uint8 buffer) to ``f``; return (size, crc32)."""
    if isinstance(source, ShardBuffer):
        return _write_known(f, source)
    crc = CrcPipe()
    written = 0
    try:
        pieces = [(0, source)] if isinstance(source, torch.Tensor) else _pieces(source)
        for offset, piece in pieces:
            if offset > written:
                pad = memoryview(bytes(offset - written))
                f.write(pad)
                crc.feed(pad)
                written = offset
            for chunk in _chunks(_host_view(piece)):
                f.write(chunk)
                crc.feed(chunk)
                written += len(chunk)
        size = source.numel() if isinstance(source, torch.Tensor) else source.size
        if size > written:
            pad = memoryview(bytes(size - written))
            f.write(pad)
            crc.feed(pad)
            written = size
    finally:
        value = crc.result()
    return written, value


def _write_known(f: IO[bytes], shard: ShardBuffer) -> tuple[int, int]:
    """Write a serialized shard; its CRC is the owner's if known, else computed here."""
    if shard.crc32 is None:
        return stream_to(f, shard.data)
    for chunk in _chunks(_bytes_view(shard.data.cpu())):
        f.write(chunk)
    return shard.data.numel(), shard.crc32


def crc_of(buffer: torch.Tensor) -> int:
    return crc32(_bytes_view(buffer))


def deserialize(
    buffer: torch.Tensor, *, weights_only: bool = False, source: str = "local checkpoint shard"
) -> TensorAwareStateDict:
    """Rebuild the state from a shard buffer; the tensors are views of ``buffer``.

    A buffer holding a file NVRx wrote (see :mod:`._nvrx_format`) is loaded as NVRx does;
    a state saved whole comes back as the user's object. ``weights_only`` is the managers'
    safe mode (see :func:`_header`); ``source`` names the shard in errors.
    """
    raw = _bytes_view(buffer)
    if _nvrx_format.is_nvrx_bytes(raw):
        return _nvrx_format.load_state(raw, weights_only=weights_only, source=source)
    if len(raw) < _PREFIX.size:
        raise CorruptCheckpointError(f"{source}: {len(raw)} bytes, too short for a shard")
    magic, version, _, header_len = _PREFIX.unpack_from(raw)
    if magic != MAGIC:
        raise CorruptCheckpointError(
            f"{source}: not a resilient_ckpt local checkpoint shard (bad magic)"
        )
    if version != FORMAT_VERSION:
        raise CheckpointingException(
            f"{source}: local checkpoint format version {version} is not supported (expected "
            f"{FORMAT_VERSION}); load it with the version of resilient_ckpt that wrote it"
        )
    body = io.BytesIO(raw[_PREFIX.size : _PREFIX.size + header_len])
    state, records = _header(body, weights_only, source)
    data_start = align(_PREFIX.size + header_len)
    tensors = [_tensor_from(buffer, data_start, r) for r in records]
    state.insert_tensors(tensors)
    if isinstance(state, WholeObject):
        return state.unwrap(weights_only=weights_only, source=source)
    return state  # type: ignore[no-any-return]


def _header(body: IO[bytes], weights_only: bool, source: str) -> tuple[Any, list[TensorRecord]]:
    """The hollow state and the tensor records of a shard header.

    Trusted (the default): unpickled freely, like ``torch.load(weights_only=False)``, because
    the job wrote its own local checkpoints and NVRx and Megatron keep arbitrary objects in
    them. ``weights_only``: with the restricted unpickler, which allows plain values, this
    format's classes and the globals the user marked safe with
    ``torch.serialization.add_safe_globals`` (see :mod:`resilient_ckpt._restricted_pickle`).
    """
    if not weights_only:
        return pickle.load(body)  # type: ignore[no-any-return]
    header = _restricted_pickle.load_state(
        body, path=source, allowed=_format_classes(), refusal=_REFUSAL, expect=tuple
    )
    if len(header) != 2 or not isinstance(header[1], list):
        raise CorruptCheckpointError(f"{source}: its header is not (state, tensor records)")
    return header  # type: ignore[no-any-return]


_REFUSAL = (
    "the manager loads with weights_only=True, which allows plain values, this format's "
    "classes and the globals marked safe (weights_only=False trusts the file: only for "
    "checkpoints your job wrote to storage no one else can write)"
)


def _format_classes() -> tuple[type, ...]:
    """The classes this format pickles in a shard header, besides the user's state."""
    return (BasicTensorAwareStateDict, TensorPlaceholder, TensorRecord, WholeObject)


def _tensor_from(buffer: torch.Tensor, data_start: int, record: TensorRecord) -> torch.Tensor:
    start = data_start + record.offset
    flat = buffer[start : start + record.nbytes]
    tensor = flat.view(record.dtype).view(record.shape) if record.nbytes else None
    if tensor is None:
        tensor = torch.empty(record.shape, dtype=record.dtype)
    if record.is_param:
        return torch.nn.Parameter(tensor, requires_grad=record.requires_grad)
    return tensor.requires_grad_(record.requires_grad) if record.requires_grad else tensor


class ShardBuffer(TensorAwareStateDict):
    """A serialized shard as a one-tensor ``TensorAwareStateDict``.

    This is what the manager hands to a replication strategy: any strategy that can move a
    ``TensorAwareStateDict`` moves a whole shard as one flat buffer, in one message per peer.
    """

    def __init__(
        self, data: torch.Tensor, crc32: int | None = None, *, arrived_crc32: int | None = None
    ) -> None:
        self._data: torch.Tensor | None = data
        self._nbytes = int(data.numel())
        # The CRC-32 of ``data`` as computed by the shard's owner, when known: replicas are
        # recorded with the owner's value, so a copy damaged in transit fails verification.
        self.crc32 = crc32
        # The CRC-32 of ``data`` as it arrived from a peer (computed chunk by chunk during
        # the transfer), when known: a measurement of these bytes, which the receiver
        # compares with the value it expects instead of reading the buffer once more.
        self.arrived_crc32 = arrived_crc32

    @property
    def data(self) -> torch.Tensor:
        if self._data is None:
            raise CheckpointingException("ShardBuffer is hollow")
        return self._data

    @property
    def is_hollow(self) -> bool:
        return self._data is None

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.data]

    def pop_tensors(self) -> list[torch.Tensor]:
        data = self.data
        self._data = None
        return [data]

    def insert_tensors(self, tensor_data: Any) -> None:
        (self._data,) = list(tensor_data)

    def init_tensors(self) -> None:
        self._data = torch.empty(self._nbytes, dtype=torch.uint8)

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        self._data = self.data.to("cpu", non_blocking=non_blocking)

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """Shards live on the host; nothing to restore."""
