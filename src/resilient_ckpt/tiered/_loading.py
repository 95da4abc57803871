"""Restore for :class:`~.manager.TieredCheckpointManager`: pick the newest verified step of any
tier, load it through ``dcp.load`` (resharding), and drop the abandoned timeline.

A mixin so the manager module holds set-up and save (:mod:`._finalizing` the finalize side)
and this one the read side; it uses the manager's attributes (``memory_dir``,
``durable_dir``, ``rank``, ``world_size``, ``_queue``, ``_pending``, ``last_restore``) and
its ``maybe_finalize``.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from .. import _dist, _telemetry
from .._logging import get_logger
from .._rank_errors import RankFailureError, from_checkpoint_exception
from ..async_ckpt.cached_metadata_filesystem_reader import WeightsOnlyLoadPlanner
from ..async_ckpt.core import AsyncRequest
from ..errors import CheckpointingException, CorruptCheckpointError, UnsafeCheckpointError
from ..storage import get_backend
from ..storage.commit import COMMIT_RECORD
from . import _restore
from ._layout import StepListing, purge_newer
from ._options import TieredOptions

logger = get_logger(__name__)


class RestoreSteps:
    """The manager's ``load`` and what it needs (mixed into the manager)."""

    options: TieredOptions
    memory_dir: str
    durable_dir: str
    rank: int
    world_size: int
    last_restore: dict[str, Any] | None
    _queue: Any
    _pending: Any
    _last_step: int | None
    _saves_since_durable: int

    def maybe_finalize(self, blocking: bool = False) -> list[int]:
        raise NotImplementedError

    def _check_open(self) -> None:
        raise NotImplementedError

    # -- load -------------------------------------------------------------------------------

    def load(self, state_dict: dict[str, Any]) -> int | None:
        """Restore the newest verified checkpoint of any tier into ``state_dict`` (in place,
        resharding as ``dcp.load`` does); return its step, or None when there is none.

        Collective. Memory is preferred when it is at least as new as durable. A checkpoint
        that fails verification on every copy is skipped for the next newest; after a
        restore, newer (unusable) checkpoints of this job are removed, so retention and
        later restores never prefer an abandoned timeline.
        """
        self._check_open()
        if self._pending:
            self.maybe_finalize(blocking=True)
        self._drain_worker()
        views: list[_restore.RankView] = _dist.all_gather_object(
            _restore.local_view(self.memory_dir, self.durable_dir, self.rank == 0)
        )
        for candidate in _restore.candidates(views):
            started = time.perf_counter()
            try:
                record = self._shared_record(candidate, views)
                reader = _dist.run_agreed(
                    f"preparing the restore of {candidate.tier} step {candidate.step}",
                    functools.partial(self._reader, candidate, record, views[self.rank].listings),
                )
                dcp.load(state_dict, storage_reader=reader, planner=self._planner(reader))
            except (CheckpointException, CheckpointingException) as exc:
                self._raise_if_refused(candidate, exc)
                logger.warning(
                    "cannot restore %s step %d (%s); trying the next newest",
                    candidate.tier,
                    candidate.step,
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                )
                continue
            logger.info(
                "restored step %d from the %s tier in %.3fs",
                candidate.step,
                candidate.tier,
                time.perf_counter() - started,
            )
            _telemetry.restore_done(
                "tiered",
                reader.bytes_read,
                time.perf_counter() - started,
                **{_telemetry.STEP: candidate.step, "resilient_ckpt.tier": candidate.tier},
            )
            self.last_restore = {
                "step": candidate.step,
                "tier": candidate.tier,
                "seconds": time.perf_counter() - started,
                "files": dict(reader.fs.used),
            }
            self._forget_newer(candidate.step)
            return candidate.step
        return None

    def _planner(self, reader: Any) -> Any:
        """dcp.load's planner: torch's default (non-tensor values unpickled freely: the
        job's own storage), or in safe mode one that loads them with ``weights_only``."""
        if not self.options.weights_only:
            return None
        return WeightsOnlyLoadPlanner(checkpoint=reader.path)

    def _raise_if_refused(self, candidate: _restore.Candidate, exc: BaseException) -> None:
        """In safe mode, a value of the state refused by ``weights_only`` fails the load on
        every rank (dcp.load's failures reach every rank) instead of falling back: an older
        checkpoint holds the same kinds of values and would be refused alike, and ``None``
        (nothing restored) would restart training from scratch. A refused commit record is
        another matter (a damaged or foreign file): its step is skipped."""
        if not self.options.weights_only or isinstance(exc, RankFailureError):
            return  # refusals of the state come from dcp.load, never from an agreement
        failures = getattr(exc, "failures", None) or {}
        errors = [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        refused = [e for e in errors if isinstance(e, UnsafeCheckpointError)]
        if refused and isinstance(exc, CheckpointException):
            error = from_checkpoint_exception(
                f"restoring {candidate.tier} step {candidate.step} (weights_only=True)", exc
            )
            error.path, error.name = refused[0].path, refused[0].name  # type: ignore[attr-defined]
            raise error from exc

    def _drain_worker(self) -> None:
        """Wait until every rank's worker has finished the calls it still runs before restore
        removes or reuses their directories. A failed save is raised as soon as one rank's
        part failed, while the other ranks' workers may still be writing that step (its other
        tier, or its files on ranks that did not fail); removing the step under them would let
        them recreate stale files in a directory the next save of that step reuses. The worker
        runs calls in order, so a no-op call finalized on every rank marks the drain. Every
        rank asks the others whether it started a worker, so that a fresh manager (nothing in
        flight) does not start one just for this."""
        started = self._queue.persistent_caller is not None
        if not _dist.max_int(int(started)):
            return
        self._queue.schedule_async_request(AsyncRequest(_drained, (), []))
        self._queue.maybe_finalize_async_calls(blocking=True)

    def _shared_record(
        self, candidate: _restore.Candidate, views: list[_restore.RankView]
    ) -> bytes | None:
        """A memory step's commit record, from the lowest rank that read it to every rank
        (ranks on a replaced node have none of their own). None for durable steps."""
        if candidate.tier != _restore.MEMORY:
            return None
        mine = views[self.rank].listings
        if not _dist.is_distributed() or all(candidate.step in v.tables for v in views):
            # Every rank read it while looking around: no broadcast needed.
            return _restore.read_commit_record(mine, candidate.step)
        holder = _restore.record_holder(views, candidate.step)
        payload: list[Any] = [None]
        if holder == self.rank:
            payload[0] = _restore.read_commit_record(mine, candidate.step)
        if holder is not None:
            dist.broadcast_object_list(payload, src=holder, group=_dist.library_group())
        return payload[0]

    def _reader(
        self, candidate: _restore.Candidate, record: bytes | None, listings: list[StepListing]
    ) -> Any:
        if candidate.tier == _restore.MEMORY:
            if record is None:
                raise CorruptCheckpointError(
                    f"rank {self.rank}: no rank could read the commit record of memory "
                    f"step {candidate.step}"
                )
            group = _dist.library_group() if _dist.is_distributed() else None
            return _restore.memory_reader(
                self.memory_dir, listings, self.rank, candidate.step, record, group
            )
        return _restore.durable_reader(self.durable_dir, candidate.step)

    def _forget_newer(self, step: int) -> None:
        """Resume from ``step``: drop newer checkpoints of the abandoned timeline."""
        purge_newer(self.memory_dir, self.rank, step)
        try:
            owners = [int(n) for n in os.listdir(self.memory_dir) if n.isdigit()]
        except FileNotFoundError:
            owners = []
        for owner in owners:  # directories of ranks beyond the new world size
            if owner >= self.world_size and owner % self.world_size == self.rank:
                purge_newer(self.memory_dir, owner, step)
        if self.rank == 0:
            backend = get_backend(self.durable_dir)
            for name in backend.scan(self.durable_dir).dirs:
                parsed = _restore.parse_step(name)
                if parsed is not None and parsed > step:
                    path = backend.join(self.durable_dir, name)
                    backend.delete(backend.join(path, COMMIT_RECORD))
                    backend.delete(path, recursive=True)
        self._last_step = step
        self._saves_since_durable = 0


def _drained() -> None:
    """The no-op call of :meth:`TieredCheckpointManager._drain_worker`."""
