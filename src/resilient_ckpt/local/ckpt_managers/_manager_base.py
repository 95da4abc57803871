"""What every local checkpoint manager holds, and the storage hooks a subclass implements.

The protocol of :class:`~.base_manager.BaseCheckpointManager` is split by phase:
:mod:`._restore` (``find_latest``, ``load``) and :mod:`._save` (``save`` and its commit)
build on this class; the hooks (listing, reading and verifying copies, the write
function, commit, retention) are all a storage implementation provides, as
:class:`~.local_manager.LocalCheckpointManager` does for local files.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ... import _dist
from ..._logging import get_logger
from ...errors import (
    CheckpointingException,
    ConfigurationError,
)
from .._background import BackgroundSaves
from .._manifest import CopyInfo
from .._shard_cache import ShardPlanCache
from ..replication import _chunked
from ..replication.strategies import ReplicationStrategy

logger = get_logger(__name__)

CkptID = tuple[int, int, Any]


class ManagerBase(ABC):
    """A manager's state and the storage hooks a subclass implements."""

    def __init__(self, session_id: Any, repl_strategy: ReplicationStrategy | None = None) -> None:
        if repl_strategy is not None and not isinstance(repl_strategy, ReplicationStrategy):
            raise ConfigurationError(
                f"repl_strategy must be a ReplicationStrategy or None, got {repl_strategy!r}"
            )
        self.latest_iteration = -1
        self.repl_strategy = repl_strategy
        # Async saves without replication prepare at staging (see SaveSteps.save).
        self.defer_planning = False
        self.session_id = session_id
        self._rank: int | None = None
        self.globally_available_ids: dict[int, list[CkptID]] = {}
        self._catalogue: list[list[CopyInfo]] = []
        self._verified: dict[CkptID, torch.Tensor] = {}
        self._inflight: set[int] = set()
        self._newest_saved = -1
        self._background = BackgroundSaves()
        # The previous save's shard layout, reused while the structure is unchanged.
        self._shard_cache = ShardPlanCache()

    @property
    def rank(self) -> int:
        if self._rank is None:
            if not _dist.has_process_group():
                logger.warning("torch.distributed is not initialised; using rank 0")
            self._rank = _dist.rank()
        return self._rank

    @property
    def world_size(self) -> int:
        return _dist.world_size()

    def _ckpt_id(self, iteration: int, owner: int | None = None) -> CkptID:
        if iteration < 0:
            raise CheckpointingException(f"invalid iteration {iteration}: must be >= 0")
        return (iteration, self.rank if owner is None else owner, self.session_id)

    def _replication_params(self) -> dict[str, Any] | None:
        return None if self.repl_strategy is None else self.repl_strategy.replication_params()

    # -- storage hooks ----------------------------------------------------------------------

    @abstractmethod
    def _list_copies(self, skip: set[int]) -> list[CopyInfo]:
        """Committed copies held here (cheap checks only); remove leftovers of interrupted
        saves except those of iterations in ``skip`` (saves in flight)."""

    @abstractmethod
    def _read_copy(self, copy: CopyInfo) -> torch.Tensor:
        """The copy's bytes, verified; ``CorruptCheckpointError`` if they do not match."""

    @abstractmethod
    def _prepare_save(self, iteration: int) -> None:
        """Make storage ready; raise if it is not writable or holds ``iteration`` or newer."""

    @abstractmethod
    def _write_request(
        self, iteration: int, ckpt_ids: Sequence[CkptID]
    ) -> tuple[Callable[..., None], list[Any]]:
        """A module-level ``write(targets, sources)`` function and the targets of the copies."""

    @abstractmethod
    def _status_path(self, iteration: int) -> str:
        """Where the trainer thread of a replicated async save reports its outcome."""

    @abstractmethod
    def _commit(self, iteration: int) -> None:
        """Make this rank's copies of ``iteration`` visible (all ranks' writes succeeded)."""

    @abstractmethod
    def _cleanup(self, iteration: int) -> None:
        """Retention after ``iteration`` was committed on every rank."""

    @abstractmethod
    def _cleanup_failed_save(self, iteration: int) -> None:
        """Remove everything this rank wrote for ``iteration``, committed or not."""

    @abstractmethod
    def _free_failed_copies(self, iteration: int) -> None:
        """Delete the uncommitted copies of a failed save (from the background thread)."""

    @abstractmethod
    def _discard(self, iterations: Sequence[int]) -> None:
        """Delete this rank's files of ``iterations`` (found incomplete)."""

    def _drop_cache(self) -> None:
        self._verified.clear()
        _chunked.release_reserved()
