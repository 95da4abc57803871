"""Replication strategies: who keeps copies of whose local checkpoint, and how they move.

Call protocol (NVRx-compatible; every rank makes each call at once, in the trainer):

1. save: ``replicate(local_ckpt, id_)`` returns the state dicts and ids this rank must
   store: its own and those of its clique peers.
2. load: ``retrieve_plan(globally_available_ids, wanted)`` decides, identically on every
   clique member, which holder of a valid copy sends each wanted id to whom;
   ``retrieve_execute(plan, my_data)`` moves the data and returns what this rank wanted.

:class:`CliqueReplicationStrategy` keeps full copies inside cliques of ``F`` ranks spaced
``J`` apart (``J`` = ranks per node puts each member on another node, so losing ``F-1``
nodes of a clique loses nothing). Each shard travels as one byte buffer (:mod:`.group_utils`):
a shard the manager already serialized goes as it is, any other ``TensorAwareStateDict`` is
serialized first and rebuilt on arrival. Senders are spread evenly (:func:`assign_senders`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from ..._logging import get_logger
from ...config import default_timeouts, local_world_size
from ...errors import ConfigurationError, NoReplicasAvailableError
from .._format import ShardBuffer, deserialize, serialize
from .._shard_cache import plan_shard
from ..base_state_dict import TensorAwareStateDict
from .group_utils import CliqueGroup, ExchangePlan, parse_group_sequence

logger = get_logger(__name__)

__all__ = [
    "CliqueReplicationStrategy",
    "ExchangePlan",
    "LazyCliqueReplicationStrategy",
    "LazyReplicationStrategyBuilder",
    "NoReplicasAvailableError",
    "ReplicationStrategy",
    "assign_senders",
    "default_replication_jump",
]

_RAW, _STATE = 0, 1


def default_replication_jump() -> int:
    """Ranks per node (``LOCAL_WORLD_SIZE``), else visible CUDA devices, else 1.

    Read at call time: a module imported before the launcher set the environment must not
    freeze a wrong value (NVRx evaluates ``torch.cuda.device_count()`` at import).
    """
    per_node = local_world_size()
    if per_node is not None:
        return per_node
    return max(torch.cuda.device_count(), 1)


def _to_buffer(state: TensorAwareStateDict) -> tuple[torch.Tensor, int]:
    if isinstance(state, ShardBuffer):
        return state.data.cpu(), _RAW
    return serialize(plan_shard(state)), _STATE


def _from_buffer(
    buf: torch.Tensor, kind: int, crc32: int | None = None, arrived_crc32: int | None = None
) -> TensorAwareStateDict:
    if kind == _RAW:
        return ShardBuffer(buf, crc32, arrived_crc32=arrived_crc32)
    # A state a clique peer of this job serialized moments ago, in flight (not a file):
    # trusted like the job's own saves. The managers' loads move raw shards (_RAW) instead.
    state = deserialize(buf.cpu())
    state.restore_tensor_device(non_blocking=False)
    return state


def assign_senders(
    ranks: Sequence[int],
    wanted_by_rank: Sequence[Sequence[Hashable]],
    held: Mapping[int, set[Hashable]],
) -> list[tuple[int, int, Hashable]]:
    """(sender, receiver, id) for every wanted id: a receiver holding it keeps its own;
    otherwise the holder with the fewest transfers so far sends (ties: lowest rank)."""
    assigned: Counter[int] = Counter()
    transfers = []
    for receiver, ids in zip(ranks, wanted_by_rank, strict=True):
        for id_ in ids:
            holders = [r for r in ranks if id_ in held.get(r, ())]
            if not holders:
                raise NoReplicasAvailableError(
                    f"no rank of replication clique {list(ranks)} holds a valid copy of {id_!r}"
                )
            sender = receiver
            if receiver not in holders:
                sender = min(holders, key=lambda r: (assigned[r], r))
                assigned[sender] += 1
            transfers.append((sender, receiver, id_))
    return transfers


class ReplicationStrategy(ABC):
    """Where copies of each rank's local checkpoint go; see the module docstring."""

    @abstractmethod
    def replicate(
        self, local_ckpt: TensorAwareStateDict, id_: Hashable
    ) -> tuple[list[TensorAwareStateDict], list[Hashable]]:
        """The state dicts (with their ids) this rank stores, its own included."""

    @abstractmethod
    def retrieve_plan(
        self, globally_available_ids: Mapping[int, Sequence[Hashable]], wanted: Sequence[Hashable]
    ) -> ExchangePlan:
        """Plan the transfers that give every rank the ids it wants."""

    @abstractmethod
    def retrieve_execute(self, *args: Any, **kwargs: Any) -> Any:
        """Carry out a plan from :meth:`retrieve_plan`."""

    def replication_params(self) -> dict[str, Any]:
        """What a checkpoint's manifest records about this strategy (compared at load)."""
        return {"strategy": type(self).__name__}


class CliqueReplicationStrategy(ReplicationStrategy):
    """Full copies of every member's shard on every member of this rank's clique.

    Args:
        local_group: the clique's process group (``None``: all ranks form one clique).
        target_device: device of the tensors ``replicate``/``retrieve_execute`` return for
            state dicts other than serialized shards.
    """

    def __init__(self, local_group: Any, target_device: Any = "cpu") -> None:
        self.local_group = CliqueGroup.wrap(local_group)
        self.target_device = target_device
        ranks = self.local_group.ranks
        self.replication_factor = len(ranks)
        self.replication_jump: int | None = ranks[1] - ranks[0] if len(ranks) > 1 else None

    def replication_params(self) -> dict[str, Any]:
        return {
            "strategy": "clique",
            "factor": self.replication_factor,
            "jump": self.replication_jump,
        }

    def replicate(
        self, local_ckpt: TensorAwareStateDict, id_: Hashable
    ) -> tuple[list[TensorAwareStateDict], list[Hashable]]:
        buf, kind = _to_buffer(local_ckpt)
        crc = local_ckpt.crc32 if isinstance(local_ckpt, ShardBuffer) else None
        described = self.local_group.all_gather_object((int(buf.numel()), id_, kind, crc))
        sizes = [d[0] for d in described]
        buffers = self.local_group.broadcast_buffers(buf, sizes, "cpu")
        me = self.local_group.ranks.index(self.local_group.my_rank)
        states = [
            local_ckpt if i == me else _from_buffer(b, d[2], d[3])
            for i, (b, d) in enumerate(zip(buffers, described, strict=True))
        ]
        logger.debug(
            "replicated %d bytes to %d peers, received %d bytes",
            buf.numel(),
            len(buffers) - 1,
            sum(sizes) - buf.numel(),
        )
        return states, [d[1] for d in described]

    def retrieve_plan(
        self, globally_available_ids: Mapping[int, Sequence[Hashable]], wanted: Sequence[Hashable]
    ) -> ExchangePlan:
        ranks = self.local_group.ranks
        wanted_by_rank = self.local_group.all_gather_object(list(wanted))
        held = {r: set(globally_available_ids[r]) for r in ranks}
        plan = ExchangePlan(self.local_group)
        for sender, receiver, id_ in assign_senders(ranks, wanted_by_rank, held):
            plan.plan(sender=sender, receiver=receiver, id_=id_)
        return plan

    def retrieve_execute(
        self, plan: ExchangePlan, my_data: Mapping[Hashable, TensorAwareStateDict]
    ) -> dict[Hashable, TensorAwareStateDict]:
        mine = {id_: _to_buffer(state) for id_, state in my_data.items()}
        received = self.local_group.execute_plan(plan, mine)
        return {
            id_: my_data[id_] if id_ in my_data else _from_buffer(buf, kind, arrived_crc32=crc)
            for id_, (buf, kind, crc) in received.items()
        }

    @classmethod
    def from_replication_params(
        cls,
        replication_jump: int | None = None,
        replication_factor: int = 2,
        *,
        backend: str | None = None,
    ) -> CliqueReplicationStrategy:
        """Create every clique's process group (collective: all ranks call it at once).

        ``replication_jump`` defaults to :func:`default_replication_jump`; ``backend``
        defaults to the default group's (pass ``"gloo"`` to keep replication traffic off
        the GPUs of an NCCL job).
        """
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigurationError(
                "CliqueReplicationStrategy.from_replication_params needs torch.distributed "
                "to be initialised first (or use LazyCliqueReplicationStrategy)"
            )
        jump = default_replication_jump() if replication_jump is None else replication_jump
        cliques = parse_group_sequence(jump, replication_factor, dist.get_world_size())
        timeout = timedelta(seconds=default_timeouts().collective)
        mine = None
        for ranks in cliques:
            group = dist.new_group(ranks, timeout=timeout, backend=backend)
            if dist.get_rank() in ranks:
                mine = group
        strategy = cls(mine, target_device="cpu")
        logger.info(
            "replication cliques of %d ranks, jump %d; this rank's clique: %s",
            replication_factor,
            jump,
            strategy.local_group.ranks,
        )
        return strategy


EagerT = TypeVar("EagerT", bound=ReplicationStrategy)


class LazyReplicationStrategyBuilder(ReplicationStrategy, ABC, Generic[EagerT]):
    """A strategy whose process groups are created on first use (NVRx-compatible)."""

    def __init__(self) -> None:
        self._replication_strategy: EagerT | None = None

    @property
    def replication_strategy(self) -> EagerT:
        if self._replication_strategy is None:
            self._replication_strategy = self._eager_build()
        return self._replication_strategy

    @abstractmethod
    def _eager_build(self) -> EagerT: ...

    def replicate(
        self, local_ckpt: TensorAwareStateDict, id_: Hashable
    ) -> tuple[list[TensorAwareStateDict], list[Hashable]]:
        return self.replication_strategy.replicate(local_ckpt, id_)

    def retrieve_plan(
        self, globally_available_ids: Mapping[int, Sequence[Hashable]], wanted: Sequence[Hashable]
    ) -> ExchangePlan:
        return self.replication_strategy.retrieve_plan(globally_available_ids, wanted)

    def retrieve_execute(self, *args: Any, **kwargs: Any) -> Any:
        return self.replication_strategy.retrieve_execute(*args, **kwargs)


class LazyCliqueReplicationStrategy(LazyReplicationStrategyBuilder[CliqueReplicationStrategy]):
    """:class:`CliqueReplicationStrategy` built on first use, e.g. before ``init_process_group``.

    The replication parameters are known without building, so manifests can be checked
    before any process group exists.
    """

    def __init__(self, replication_jump: int | None = None, replication_factor: int = 2) -> None:
        super().__init__()
        self.replication_jump = replication_jump
        self.replication_factor = replication_factor

    def replication_params(self) -> dict[str, Any]:
        if self._replication_strategy is not None:
            return self._replication_strategy.replication_params()
        jump = self.replication_jump
        if jump is None:
            jump = default_replication_jump()
        return {
            "strategy": "clique",
            "factor": self.replication_factor,
            "jump": jump if self.replication_factor > 1 else None,
        }

    def _eager_build(self) -> CliqueReplicationStrategy:
        return CliqueReplicationStrategy.from_replication_params(
            self.replication_jump, self.replication_factor
        )
