"""Forwarding a lost shard while its replica is being verified (recovery after a node loss).

When a rank lost its copy, a peer verifies the replica in ``find_latest``'s first round (a
disk read) and the owner needs those bytes (a transfer). Every rank knows before any byte is
read who verifies which replica (the first round is decided from the shared catalogue), so
the holder sends each chunk as soon as it is read and checksummed and the owner receives
meanwhile: the transfer hides behind the read, and ``load`` finds the shard at its owner.

Why it is safe:

* One sender per lost shard, the same on every rank: the lowest rank verifying a replica in
  the first round. Only replicas in our format (their manifest has the CRC the owner checks),
  only over a host-memory (gloo) clique.
* The sender always sends exactly the manifest's size, zeros where it could not read, so the
  owner never waits for bytes that will not come; the owner counts the shard verified only if
  the CRC measured on arrival matches, else the second round and ``load``'s transfer take over.
* The chunks are :mod:`._chunked`'s under a tag of their own, and every forward completes
  before the round's agreement, so they never meet a later exchange's messages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..._checksum import crc32
from ..._logging import get_logger
from .._manifest import CopyInfo
from .._verified_read import check_against_manifest, map_private
from . import _chunked
from .group_utils import CliqueGroup

logger = get_logger(__name__)

FORWARD_TAG = _chunked.MAX_TAG  # the exchange plans' transfers count up from 0


def clique_for_forwarding(strategy: Any) -> CliqueGroup | None:
    """The strategy's clique if forwarding can run over it (host memory), else None; the
    same answer on every member (same strategy class, same backend)."""
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
    """The bytes of ``copy`` verified, each chunk handed to ``send(chunk, index)`` once
    checksummed; every chunk is sent even if the file cannot be read (zeros). Raises like
    ``read_verified``, after sending."""
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
