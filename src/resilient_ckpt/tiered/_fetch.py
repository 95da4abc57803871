"""Memory-tier restore across nodes: each rank receives, over the process group, the data
files it needs but cannot read from its own node.

The memory tier is node-local: after a node is lost and replaced, the new node's ranks start
with empty memory directories, while copies of their shards sit in RAM on their clique
peers' nodes. ``dcp.load`` calls the storage reader's ``read_data`` on every rank once,
between two collectives, so the exchange runs there, with the load plan known:

1. each rank verifies (size + CRC-32) the files its plan reads that it has copies of, and
   lists those it has no valid copy of;
2. when some rank misses something (one all-reduce says), one all-gather of (missing,
   reachable) lists; every rank computes the same assignment of
   each missing file to a rank that can reach it (the least loaded in bytes, then the
   lowest rank);
3. the transfers run in that one global order with blocking point-to-point sends, so every
   pair meets in the same order on both sides (no cycles, no deadlock); a provider whose own
   copy turns out corrupt sends a refusal instead of bytes, and the receiver checks the
   bytes it gets against the commit record's CRC-32 before using them.

Every rank finishes the exchange before any raises, so a file nobody holds, or one that
arrives corrupt, fails ``dcp.load`` on every rank together (the manager then tries the
next checkpoint) instead of leaving peers waiting. Each wait is bounded by the group's
timeout. On one host every directory is reachable and nothing crosses the group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .. import _checksum
from .._logging import get_logger
from ..errors import CorruptCheckpointError

if TYPE_CHECKING:
    from ._verifying_reader import LocatingFileSystem

logger = get_logger(__name__)

Transfer = tuple[int, str, int | None]  # requester, file name, provider (None: nobody has it)


def plan_transfers(
    wants: list[tuple[list[str], list[str]]], sizes: dict[str, int]
) -> list[Transfer]:
    """Who sends what to whom, from every rank's (missing, reachable) lists: the same list
    on every rank. Each missing file goes to the rank that can reach it with the fewest
    bytes assigned so far (ties: the lowest rank)."""
    load = [0] * len(wants)
    transfers: list[Transfer] = []
    for requester, (missing, _) in enumerate(wants):
        for name in sorted(missing):
            holders = [r for r, (_, reach) in enumerate(wants) if r != requester and name in reach]
            provider = min(holders, key=lambda r: (load[r], r)) if holders else None
            if provider is not None:
                load[provider] += sizes.get(name, 0)
            transfers.append((requester, name, provider))
    return transfers


def exchange_missing(fs: LocatingFileSystem, needed: list[str], group: Any) -> None:
    """Collective on ``group``: afterwards ``fs`` holds a verified copy of every file in
    ``needed``, or this raises ``CorruptCheckpointError`` (on every rank that lacks one)."""
    me = dist.get_rank(group)
    missing = []
    for name in needed:
        try:
            fs.verified(name)
        except CorruptCheckpointError:
            missing.append(name)
    count = torch.tensor([len(missing)], dtype=torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    if not count.item():
        return  # every rank reads all it needs on its own node (a restart, one host)
    wants: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(wants, (missing, fs.reachable()), group=group)
    sizes = {name: size for name, (size, _) in fs.table.items()}
    problems = []
    for requester, name, provider in plan_transfers(wants, sizes):
        if provider is None:
            if requester == me:
                problems.append(f"{name}: no rank can reach a copy")
        elif provider == me:
            _send(fs, name, requester, group)
        elif requester == me:
            try:
                fs.adopt(name, _receive(fs, name, provider, group), f"rank {provider}")
            except CorruptCheckpointError as exc:
                problems.append(str(exc))
    if problems:
        raise CorruptCheckpointError(
            f"rank {me}: memory-tier files this rank needs could not be fetched: "
            + "; ".join(problems)
        )
    received = [n for n in missing if fs.used.get(n, "").startswith("rank ")]
    if received:
        logger.info("received %d memory-tier file(s) from peers: %s", len(received), received)


def _send(fs: LocatingFileSystem, name: str, to: int, group: Any) -> None:
    try:
        data: torch.Tensor | None = fs.verified(name)
    except CorruptCheckpointError as exc:
        logger.warning("cannot serve %s to rank %d: %s", name, to, exc)
        data = None
    size = -1 if data is None else data.numel()
    dist.send(torch.tensor([size], dtype=torch.int64), dst=_global(group, to), group=group)
    if data is not None and size:
        dist.send(data, dst=_global(group, to), group=group)


def _receive(fs: LocatingFileSystem, name: str, sender: int, group: Any) -> torch.Tensor:
    header = torch.empty(1, dtype=torch.int64)
    dist.recv(header, src=_global(group, sender), group=group)
    size = int(header.item())
    if size < 0:
        raise CorruptCheckpointError(f"{name}: rank {sender} has no valid copy to send")
    data = torch.empty(size, dtype=torch.uint8)
    if size:
        dist.recv(data, src=_global(group, sender), group=group)
    expected_size, expected_crc = fs.table[name]
    view: Any = data.numpy()
    if size != expected_size or _checksum.crc32(memoryview(view)) != expected_crc:
        raise CorruptCheckpointError(
            f"{name} from rank {sender} does not match the commit record "
            f"({size} bytes; expected {expected_size} with CRC-32 {expected_crc:#010x})",
            path=name,
        )
    return data


def _global(group: Any, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank)
