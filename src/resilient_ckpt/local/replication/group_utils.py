"""Replication groups and the byte exchanges inside one group.

Decision: everything that crosses the network is a *whole flat byte buffer* per shard: one
broadcast per clique member when replicating, one point-to-point transfer per (sender,
receiver) pair when retrieving (in checksummed chunks, :mod:`._chunked`). NVRx sends one
message per tensor, and a real state has thousands, each a round trip and a small copy. The
buffers are uint8 tensors, so the same code runs over gloo and NCCL (moved to the current
CUDA device for the transfer). Sizes travel first, so every receiver allocates exactly what
it gets.

NVRx's names live here too, for code written against it: ``GroupWrapper``
(:mod:`._group_wrapper`), ``ProcessGroupLike`` and ``batched``.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ... import _dist
from ...errors import CheckpointingException, ConfigurationError
from ._chunked import IncomingBuffer, send_buffer
from ._group_wrapper import GroupWrapper

__all__ = [
    "CliqueGroup",
    "ExchangePlan",
    "ExchangePlanEntry",
    "GroupWrapper",
    "ProcessGroupLike",
    "batched",
    "parse_group_sequence",
]

T = TypeVar("T")

# What NVRx's signatures accept as a group: a wrapper or a torch process group.
ProcessGroupLike = GroupWrapper | dist.ProcessGroup


def batched(iterable: Iterable[T], n: int) -> Iterator[tuple[T, ...]]:
    """Consecutive tuples of ``n`` items (the last may be shorter), as Python 3.12's
    ``itertools.batched``."""
    if not isinstance(n, int) or n < 1:
        raise ConfigurationError(f"batch size must be an int >= 1, got {n!r}")
    iterator = iter(iterable)
    while batch := tuple(islice(iterator, n)):
        yield batch


def parse_group_sequence(
    replication_jump: int, replication_factor: int, world_size: int
) -> list[list[int]]:
    """The cliques ``{n, n+J, ..., n+(F-1)J}`` covering ``range(world_size)``, sorted: ranks
    ``b, b+J, b+2J, ...`` (each ``b < J``) cut into runs of ``F``. ``world_size`` must be
    divisible by ``J*F``."""
    for name, value in (
        ("replication_jump", replication_jump),
        ("replication_factor", replication_factor),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigurationError(f"{name} must be a positive integer, got {value!r}")
    if world_size % (replication_jump * replication_factor) != 0:
        raise ConfigurationError(
            f"cannot split {world_size} ranks into replication cliques of "
            f"replication_factor={replication_factor} ranks spaced replication_jump="
            f"{replication_jump} apart: the world size must be divisible by jump*factor="
            f"{replication_jump * replication_factor}"
        )
    cliques: list[list[int]] = []
    for base in range(replication_jump):
        column = range(base, world_size, replication_jump)
        cliques.extend(list(run) for run in batched(column, replication_factor))
    return sorted(cliques)


@dataclass(frozen=True)
class ExchangePlanEntry:
    """``sender`` gives its copy of ``id_`` to ``receiver`` (global ranks)."""

    sender: int
    receiver: int
    id_: Hashable


@dataclass
class ExchangePlan:
    """Who sends which checkpoint id to whom; identical on every member of ``group``."""

    group: Any  # a CliqueGroup, or NVRx's GroupWrapper
    _entries: list[ExchangePlanEntry] = field(default_factory=list)

    def plan(self, sender: int, receiver: int, id_: Hashable) -> None:
        self._entries.append(ExchangePlanEntry(sender, receiver, id_))

    @property
    def entries(self) -> tuple[ExchangePlanEntry, ...]:
        return tuple(self._entries)

    def required_ids(self, rank: int | None = None) -> set[Hashable]:
        """Ids that ``rank`` (default: this process) must provide."""
        rank = dist.get_rank() if rank is None else rank
        return {e.id_ for e in self._entries if e.sender == rank}


class CliqueGroup:
    """A process group (``None``: the whole world) with buffer-level exchanges."""

    def __init__(self, group: Any = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigurationError(
                "replication needs torch.distributed to be initialised (init_process_group) "
                "before the replication strategy is used"
            )
        self.group = group

    @staticmethod
    def wrap(group: Any) -> CliqueGroup:
        """A clique over ``group``: a process group, None, or NVRx's ``GroupWrapper``."""
        if isinstance(group, CliqueGroup):
            return group
        if isinstance(group, GroupWrapper):
            return CliqueGroup(group.group)
        return CliqueGroup(group)

    @property
    def ranks(self) -> list[int]:
        if self.group is None:
            return list(range(dist.get_world_size()))
        return list(dist.get_process_group_ranks(self.group))

    @property
    def my_rank(self) -> int:
        return _dist.rank()

    @property
    def backend(self) -> str:
        return str(dist.get_backend(self.group))

    @property
    def comm_device(self) -> torch.device:
        if "gloo" in self.backend or not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * len(self.ranks)
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_buffers(
        self, mine: torch.Tensor, sizes: Sequence[int], target_device: Any = "cpu"
    ) -> list[torch.Tensor]:
        """Every member's buffer, in clique order (``sizes``: every member's byte count)."""
        device = self.comm_device
        result = []
        for position, src in enumerate(self.ranks):
            if src == self.my_rank:
                buf = mine if mine.device == device else mine.to(device)
            else:
                buf = torch.empty(int(sizes[position]), dtype=torch.uint8, device=device)
            dist.broadcast(buf, src=src, group=self.group)
            result.append(mine if src == self.my_rank else buf.to(target_device))
        return result

    def _p2p(self, ops: list[Any]) -> None:
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def execute_plan(
        self, plan: ExchangePlan, mine: Mapping[Hashable, tuple[torch.Tensor, int]]
    ) -> dict[Hashable, tuple[torch.Tensor, int, int | None]]:
        """Carry out ``plan``; ``mine`` maps ids to (buffer, kind) this rank must send.

        Returns (buffer, kind, crc) for every id this rank receives; ``crc`` is a peer's
        buffer's CRC-32 measured on arrival (:mod:`._chunked`), None for this rank's own
        buffers and for buffers on a GPU.
        """
        me, device = self.my_rank, self.comm_device
        missing = plan.required_ids(me) - set(mine)
        if missing:
            raise CheckpointingException(f"rank {me} must send ids it was not given: {missing}")
        result: dict[Hashable, tuple[torch.Tensor, int, int | None]] = {}
        headers: dict[int, torch.Tensor] = {}
        ops = []
        for tag, entry in enumerate(plan.entries):
            if entry.sender == entry.receiver == me:
                result[entry.id_] = (*mine[entry.id_], None)
            elif entry.sender == me:
                buf, kind = mine[entry.id_]
                header = torch.tensor([buf.numel(), kind], dtype=torch.int64, device=device)
                ops.append(dist.P2POp(dist.isend, header, entry.receiver, self.group, tag))
            elif entry.receiver == me:
                headers[tag] = torch.empty(2, dtype=torch.int64, device=device)
                ops.append(dist.P2POp(dist.irecv, headers[tag], entry.sender, self.group, tag))
        self._p2p(ops)
        sends, incoming = [], {}
        for tag, entry in enumerate(plan.entries):
            if entry.sender == me != entry.receiver:
                buf = mine[entry.id_][0].to(device)
                sends.extend(send_buffer(buf, entry.receiver, self.group, tag))
            elif entry.receiver == me != entry.sender:
                size, kind = (int(v) for v in headers[tag].tolist())
                transfer = IncomingBuffer(size, entry.sender, self.group, tag, device)
                incoming[entry.id_] = (transfer, kind)
        for id_, (transfer, kind) in incoming.items():
            crc = transfer.wait()
            result[id_] = (transfer.buffer.cpu(), kind, crc)
        for work in sends:
            work.wait()
        return result

    def __repr__(self) -> str:
        return f"CliqueGroup(ranks={self.ranks}, backend={self.backend})"
