"""Forwarding a lost shard while its replica is being verified (recovery after a node loss).

Decision: when a rank lost its local copy (its node was replaced), ``find_latest`` has a peer
verify the replica of that shard in its first round, and ``load`` then sent the verified
bytes to the owner: a disk read, then a network transfer of the same bytes, one after the
other. Both
ends know before any byte is read who will verify which replica (the first round is decided
from the catalogue that every rank has), so the holder can send each chunk of the file as
soon as it has read and checksummed it, and the owner receives it meanwhile. The transfer
then hides behind the reads, and ``load`` finds the shard already at its owner.

Rules that keep it safe:

* One designated sender per lost shard: the lowest rank that verifies its replica in the
  first round (the same on every rank). Only replicas in this library's format (their
  manifest has the CRC-32 the owner checks), and only over a host-memory (gloo) clique.
* The sender always sends exactly the manifest's size, zeros where it could not read, so the
  owner never waits for bytes that will not come. The owner checks the CRC-32 it measured
  on arrival against the manifest and counts the shard as verified only if it matches;
  otherwise the usual second round and ``load``'s transfer take over, as before.
* The chunks are those of :mod:`._chunked` under a tag of their own, and every forward is
  complete before the round's agreement, so they never meet a later exchange's messages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..._checksum import crc32
from ..._logging import get_logger
from .._manifest import CopyInfo
from .._reader import check_against_manifest, map_private
from . import _chunked
from .group_utils import CliqueGroup

logger = get_logger(__name__)

FORWARD_TAG = _chunked.MAX_TAG  # the exchange plans' transfers count up from 0


def clique_for_forwarding(strategy: Any) -> CliqueGroup | None:
    """The strategy's clique when forwarding is possible over it (host memory), else None.

    Every member of a clique gets the same answer: same strategy class, same backend.
    """
    eager = getattr(strategy, "replication_strategy", strategy)
    group = getattr(eager, "local_group", None)
    if not isinstance(group, CliqueGroup) or group.comm_device.type != "cpu":
        return None
    return group


def forwards(
    first_rounds: Sequence[list[CopyInfo]], present: set[int]
) -> dict[int, tuple[int, CopyInfo]]:
    """``owner -> (sender, copy)`` for each shard whose owner holds no copy of its own:
    the lowest rank whose first round (``first_rounds[holder]``) verifies a replica of it."""
    chosen: dict[int, tuple[int, CopyInfo]] = {}
    for holder, copies in enumerate(first_rounds):
        for copy in copies:
            if copy.owner in present or copy.owner in chosen or copy.nvrx:
                continue
            chosen[copy.owner] = (holder, copy)
    return chosen


def read_and_forward(copy: CopyInfo, send: Callable[[torch.Tensor, int], Any]) -> torch.Tensor:
    """The bytes of ``copy`` verified, each chunk handed to ``send(chunk, index)`` as soon as
    it is checksummed; every chunk is sent even when the file cannot be read (zeros).

    Raises like ``read_verified`` (``CorruptCheckpointError``, ``OSError``) after sending.
    """
    sent = 0
    works: list[Any] = []
    try:
        mapping = map_private(copy.path, copy.size, copy.crc32)  # checks the size
        if mapping is None:
            if copy.size:
                raise OSError(f"{copy.path}: cannot be mapped to be forwarded")
            check_against_manifest(copy.path, 0, 0, 0, copy.crc32)
            buffer = torch.empty(0, dtype=torch.uint8)
        else:
            buffer = torch.frombuffer(mapping, dtype=torch.uint8)
            value = 0
            for index, chunk in enumerate(_chunked.split(buffer)):
                array: Any = chunk.numpy()
                value = crc32(memoryview(array).cast("B"), value)
                works.append(send(chunk, index))
                sent += 1
            check_against_manifest(copy.path, copy.size, value, copy.size, copy.crc32)
        return buffer
    finally:
        if sent < _chunked.chunk_count(copy.size):  # failed early: zeros, so nobody waits
            filler = torch.zeros(copy.size, dtype=torch.uint8)
            for index, chunk in enumerate(_chunked.split(filler)):
                if index >= sent:
                    works.append(send(chunk, index))
        for work in works:
            work.wait()


def forward(copy: CopyInfo, receiver: int, clique: CliqueGroup) -> torch.Tensor:
    """Verify ``copy`` while sending it to global rank ``receiver`` (see the module)."""
    logger.info(
        "forwarding the replica of rank %d's shard (iteration %d) while verifying it",
        copy.owner,
        copy.iteration,
    )
    return read_and_forward(
        copy,
        lambda chunk, index: _chunked.post_send(chunk, index, receiver, clique.group, FORWARD_TAG),
    )


def expect(copy: CopyInfo, sender: int, clique: CliqueGroup) -> _chunked.IncomingBuffer:
    """Post the receive of this rank's own shard, forwarded by global rank ``sender``."""
    _chunked.reserve(copy.size)
    return _chunked.IncomingBuffer(
        copy.size, sender, clique.group, FORWARD_TAG, torch.device("cpu")
    )


def received(incoming: _chunked.IncomingBuffer, copy: CopyInfo, sender: int) -> torch.Tensor | None:
    """The forwarded shard if its arrival CRC matches the sender's manifest, else None."""
    value = incoming.wait()
    if incoming.buffer.numel() == copy.size and value == copy.crc32:
        return incoming.buffer
    logger.warning(
        "the copy of rank %d's shard forwarded by rank %d does not match its manifest; "
        "other replicas are tried",
        copy.owner,
        sender,
    )
    return None
