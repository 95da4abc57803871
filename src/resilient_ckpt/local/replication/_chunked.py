"""One shard buffer from one rank to another, in chunks, checksummed as the chunks arrive.

A recovering rank must check the CRC-32 of the shard it receives; checking after the whole
buffer arrived would put a full pass over the bytes on the recovery's critical path. So the
sender posts one message per chunk, the receiver posts all receives at once and checksums
each chunk while the next are in flight. The bytes land in one flat buffer (the shard's
tensors are views of it). Chunks are ordinary point-to-point messages told apart by tag: the
transfer's (its place in the exchange plan) in the high bits, the chunk index in the low.
GPU (NCCL) buffers travel as one message and the caller checksums them on the host.

A rank that knows it will receive its shard can :func:`reserve` the buffer early, while its
peers verify what they will send, so first-touch page faults and zeroing happen off the
critical path; :func:`release_reserved` drops an unused one.
"""

from __future__ import annotations

import mmap
from typing import Any

import torch
import torch.distributed as dist

from ..._checksum import crc32
from ...errors import CheckpointingException

__all__ = [
    "CHUNK_BYTES",
    "MAX_TAG",
    "IncomingBuffer",
    "chunk_count",
    "post_send",
    "release_reserved",
    "reserve",
    "send_buffer",
    "split",
]

CHUNK_BYTES = 32 << 20
_INDEX_BITS = 20  # chunks per buffer: 2**20 * 32 MiB, far beyond any shard
MAX_TAG = (1 << (31 - _INDEX_BITS)) - 1  # torch's tags are C ints


_reserved: dict[int, torch.Tensor] = {}


def reserve(size: int) -> None:
    """Allocate and pre-fault a host buffer for the next receive of ``size`` bytes."""
    if size <= 0 or size in _reserved:
        return
    populate = getattr(mmap, "MAP_POPULATE", None)  # Linux: the kernel faults every page in
    if populate is None:
        return
    try:
        memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
    except (OSError, ValueError, MemoryError):
        return  # an optimisation only: the receive allocates its buffer itself
    _reserved[size] = torch.frombuffer(memory, dtype=torch.uint8)


def release_reserved() -> None:
    """Drop the buffers reserved and not used."""
    _reserved.clear()


def _receive_buffer(size: int, device: torch.device) -> torch.Tensor:
    if device.type == "cpu" and size in _reserved:
        return _reserved.pop(size)
    return torch.empty(size, dtype=torch.uint8, device=device)


def split(buf: torch.Tensor) -> list[torch.Tensor]:
    """The chunks ``buf`` travels in (one per message), as views of it."""
    if buf.device.type != "cpu" or buf.numel() <= CHUNK_BYTES:
        return [buf]
    return list(torch.split(buf, CHUNK_BYTES))


def chunk_count(size: int) -> int:
    """How many chunks :func:`split` makes of a host buffer of ``size`` bytes."""
    return max(1, -(-size // CHUNK_BYTES))


def _chunk_tag(tag: int, index: int) -> int:
    if not 0 <= tag <= MAX_TAG:
        raise CheckpointingException(
            f"exchange plan too long: transfer #{tag} exceeds {MAX_TAG} transfers per group"
        )
    return (tag << _INDEX_BITS) | index


def _posted(work: Any, what: str, peer: int) -> Any:
    if work is None:  # torch returns None to a rank outside the group
        raise CheckpointingException(f"cannot {what} rank {peer}: this rank is not in the group")
    return work


def post_send(chunk: torch.Tensor, index: int, peer: int, group: Any, tag: int) -> Any:
    """Post the send of chunk ``index`` of a transfer to global rank ``peer``; wait for it."""
    return _posted(
        dist.isend(chunk, peer, group=group, tag=_chunk_tag(tag, index)), "send to", peer
    )


def send_buffer(buf: torch.Tensor, peer: int, group: Any, tag: int) -> list[Any]:
    """Post the sends of ``buf`` to global rank ``peer``; wait for the returned works."""
    return [post_send(chunk, i, peer, group, tag) for i, chunk in enumerate(split(buf))]


class IncomingBuffer:
    """A buffer of ``size`` bytes being received from global rank ``peer``."""

    def __init__(self, size: int, peer: int, group: Any, tag: int, device: torch.device) -> None:
        self.buffer = _receive_buffer(size, device)
        self._chunks = split(self.buffer)
        self._works = [
            _posted(
                dist.irecv(chunk, peer, group=group, tag=_chunk_tag(tag, i)), "receive from", peer
            )
            for i, chunk in enumerate(self._chunks)
        ]

    def wait(self) -> int | None:
        """Wait for every chunk; the CRC-32 of the buffer (None if it is not on the host)."""
        on_host = self.buffer.device.type == "cpu"
        value = 0
        for chunk, work in zip(self._chunks, self._works, strict=True):
            work.wait()
            if on_host and chunk.numel():
                array: Any = chunk.numpy()
                value = crc32(memoryview(array).cast("B"), value)
        return value if on_host else None
