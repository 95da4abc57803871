"""``TieredCheckpointManager``: one snapshot feeding a RAM tier with peer replicas and a
durable tier; restore from the newest verified checkpoint on any tier, at any world size.

Call protocol (every rank makes every call, in the same order, from the training thread)::

    mgr = TieredCheckpointManager(
        memory_dir,
        durable_dir,
        replication_factor=2,
        replication_jump=None,
        durable_every=10,
        keep_memory=2,
        keep_durable=2,
    )  # collective: makes groups
    step = mgr.load(state_dict)  # collective; in place like dcp.load; step or None
    mgr.save(state_dict, step)  # collective planning, then the snapshot; returns
    mgr.maybe_finalize(blocking=False)  # commits what finished; errors raise on every rank
    mgr.close()  # finalizes what is pending, stops the background

What runs where (see the modules for each decision):

* ``save`` (trainer): plans the DCP save for this rank's memory-tier step directory (plan
  cached while the state's structure is unchanged), then schedules one ``AsyncRequest``;
  the queue stages the tensors once into the persistent worker's shared-memory arena.
  That copy is the whole stall, the same for a save that also goes durable
  (:mod:`._writes`).
* worker process: writes the memory-tier files, then on durable saves the same staged
  bytes to ``durable_dir/step_<N>`` as a standard DCP checkpoint.
* replicator thread of the trainer (:mod:`._replicator`): once the memory files exist,
  exchanges them with the clique peers over the manager's gloo groups, writes the commit
  record into every rank's step directory, applies ``keep_memory``.
* ``maybe_finalize`` (trainer): agrees on finished worker calls (library gloo group),
  commits durable saves (``.metadata`` last, coordinator) and applies ``keep_durable``, and
  re-raises any failure of either tier, on every rank.
* ``load``: :mod:`._restore` picks the candidates, :mod:`._verifying_reader` reads and verifies.

What the training thread waits for: in ``save``, the plan (with a cached plan, one small
gloo all-gather that revalidates it) and the staging copy (a memcpy of the state into the
arena; a wait only if both arenas still hold unwritten snapshots); in ``maybe_finalize``,
one small gloo exchange per pending worker call and, for a durable save, its commit (an
all-reduce of the write results and the coordinator's ``.metadata`` write). It never waits
for the memory-tier writes, the replica exchange or the durable data writes.

``durable_every``: the ``durable_every``-th save after construction (or after a load), and
every ``durable_every``-th after it, also goes durable; ``save(..., durable=True)`` forces one.
"""

from __future__ import annotations

import copy
import functools
import os
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .. import _dist, _telemetry
from .._logging import get_logger
from ..async_ckpt.core import AsyncCallsQueue, AsyncRequest
from ..async_ckpt.state_dict_saver import (
    CheckpointMetadataCache,
    save_state_dict_async_plan,
)
from ..async_ckpt.warmup import warmup_async_save
from ..config import Timeouts, default_timeouts
from ..errors import (
    ConfigurationError,
    QueueClosedError,
)
from ..local.replication.group_utils import CliqueGroup, parse_group_sequence
from ..local.replication.strategies import default_replication_jump
from ..storage import get_backend
from ..storage.retention import prune_checkpoints
from ._finalizing import FinalizeSteps, PendingSave
from ._layout import memory_step_dir, rank_dir, remove_step
from ._loading import RestoreSteps
from ._options import TieredOptions
from ._phases import PhaseHook, TieredPhase
from ._replicator import MemorySave, Replicator
from ._writes import (
    DurableCopyWriter,
    commit_durable,
    durable_job_of,
    open_durable_writer,
    open_memory_writer,
    plain_state,
    split_save_function,
    write_tiers,
    writer_options,
)

logger = get_logger(__name__)

__all__ = ["TieredCheckpointManager"]


def _cliques(jump: int, factor: int, world_size: int, jump_defaulted: bool) -> list[list[int]]:
    """The replication cliques; where they cannot be formed, the error says how to fix it."""
    try:
        return parse_group_sequence(jump, factor, world_size)
    except ConfigurationError as exc:
        if not jump_defaulted or world_size % factor != 0:
            raise
        raise ConfigurationError(
            f"{exc}. replication_jump defaulted to {jump}, the ranks per node "
            "(LOCAL_WORLD_SIZE), so that each copy lands on another node: that needs a "
            f"number of nodes divisible by replication_factor={factor}. On one node pass "
            "replication_jump=1 (copies on other ranks of the node: they survive a rank's "
            "crash, not the node's loss), or replication_factor=1 (no copies)"
        ) from exc


class TieredCheckpointManager(FinalizeSteps, RestoreSteps):
    """Checkpoints in node-local RAM with peer replicas, every N-th also durable.

    Args:
        memory_dir: node-local RAM tier, e.g. ``/dev/shm/<job>``; each rank writes below
            ``memory_dir/<rank>/``.
        durable_dir: shared storage path or ``msc://profile/prefix``.
        replication_factor: copies of each rank's shard in the memory tier (cliques of this
            many ranks, as ``CliqueReplicationStrategy``; 1 = no replicas).
        replication_jump: distance between clique members; default: ranks per node
            (``LOCAL_WORLD_SIZE``), so each copy lands on another node. The world size must
            be divisible by ``replication_jump * replication_factor``.
        durable_every: every ``durable_every``-th save also goes to ``durable_dir``.
        keep_memory, keep_durable: committed checkpoints kept per tier (older ones are
            deleted only after a newer one is committed).
        thread_count: writer threads (and data files) per rank and tier.
        durable_sync: fsync durable files (memory-tier files are never fsynced: RAM).
        timeouts: deadlines (default :func:`resilient_ckpt.config.default_timeouts`).
        on_phase: ``fn(phase, step)`` called at each :class:`~._phases.TieredPhase` of a
            save (from the trainer or the replicator thread, as documented there):
            instrumentation, and the fault kit's hook
            (:func:`resilient_ckpt.testing.faults.kill_at_tiered_phase`).
        weights_only: the safe mode of ``load``. Default False: the state's non-tensor
            values are unpickled freely, as ``dcp.load`` does (the job trusts what it wrote
            to its own tiers; whoever can write them can run code in the job). True: with
            ``torch.load(weights_only=True)``, whose allow-list the user extends with
            ``torch.serialization.add_safe_globals``; a refused value fails ``load`` on
            every rank with :class:`~resilient_ckpt.errors.UnsafeCheckpointError` (it does
            not fall back to an older checkpoint, which would be refused alike). Commit
            records are never unpickled freely, in either mode.
    """

    def __init__(
        self,
        memory_dir: str | os.PathLike,
        durable_dir: str | os.PathLike,
        replication_factor: int = 2,
        replication_jump: int | None = None,
        durable_every: int = 10,
        keep_memory: int = 2,
        keep_durable: int = 2,
        *,
        thread_count: int = 1,
        durable_sync: bool = True,
        timeouts: Timeouts | None = None,
        on_phase: PhaseHook | None = None,
        weights_only: bool = False,
    ) -> None:
        self.options = TieredOptions(
            os.fspath(memory_dir),
            os.fspath(durable_dir),
            replication_factor,
            replication_jump,
            durable_every,
            keep_memory,
            keep_durable,
            thread_count,
            durable_sync,
            weights_only,
        )
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigurationError(
                "TieredCheckpointManager needs torch.distributed initialised first "
                "(init_process_group), on every rank"
            )
        self.timeouts = timeouts or default_timeouts()
        self.rank = _dist.rank()
        self.world_size = dist.get_world_size()
        self.memory_dir = self.options.memory_dir
        self.durable_dir = self.options.durable_dir
        self.on_phase: PhaseHook = on_phase or (lambda phase, step: None)
        jump = replication_jump if replication_jump is not None else default_replication_jump()
        self.replication_jump = jump
        cliques = _cliques(jump, replication_factor, self.world_size, replication_jump is None)
        self.clique_ranks = next(c for c in cliques if self.rank in c)
        self._world_group, clique = self._make_groups(cliques)
        _dist.run_agreed("tiered manager set-up", self._prepare_dirs)
        self._queue = AsyncCallsQueue(persistent=True, timeouts=self.timeouts)
        self._cache = CheckpointMetadataCache()
        self._replicator = Replicator(
            memory_dir=self.memory_dir,
            rank=self.rank,
            world=self._world_group,
            clique=clique,
            keep_memory=keep_memory,
            report_timeout=self.timeouts.finalize,
            on_phase=self._phase,
        )
        self._pending: deque[PendingSave] = deque()
        self._last_step: int | None = None
        self._saves_since_durable = 0
        self._closed = False
        self.timings: dict[int, dict[str, float]] = {}
        self.last_restore: dict[str, Any] | None = None  # set by load

    # -- set-up -----------------------------------------------------------------------------

    def _make_groups(self, cliques: list[list[int]]) -> tuple[Any, CliqueGroup | None]:
        """The replicator's own gloo groups (collective: every rank creates every group)."""
        timeout = timedelta(seconds=self.timeouts.collective)
        world = dist.new_group(backend="gloo", timeout=timeout)
        mine = None
        if self.options.replication_factor > 1:
            for ranks in cliques:
                group = dist.new_group(ranks, backend="gloo", timeout=timeout)
                if self.rank in ranks:
                    mine = CliqueGroup(group)
        return world, mine

    def _prepare_dirs(self) -> None:
        os.makedirs(rank_dir(self.memory_dir, self.rank), exist_ok=True)
        if self.rank == 0:
            get_backend(self.durable_dir).makedirs(self.durable_dir)

    def _phase(self, phase: TieredPhase, step: int) -> None:
        self.on_phase(phase, step)

    # -- save -------------------------------------------------------------------------------

    def warmup(self, state_dict: dict[str, Any]) -> None:
        """Make the first save of ``state_dict``'s structure cost a steady one; collective.

        Plans the state once (the plan cache then serves the saves), starts the background
        worker and its copy threads, and pre-faults a staging arena for the state's bytes.
        Writes nothing. Pass a state laid out as the saves' will be (same keys, shapes,
        placements); other values are fine.
        """
        self._check_open()
        warmup_async_save(
            plain_state(state_dict),
            self._queue,
            metadata_cache=self._cache,
            **writer_options(self.options),
        )

    def save(self, state_dict: dict[str, Any], step: int, *, durable: bool | None = None) -> None:
        """Snapshot ``state_dict`` as checkpoint ``step`` (collective); writes in background.

        Returns once the state is staged: training may modify its tensors at once. Steps
        must increase. Failures of the background work surface from :meth:`maybe_finalize`.
        """
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ConfigurationError(f"step must be an int >= 0, got {step!r}")
        if self._last_step is not None and step <= self._last_step:
            raise ConfigurationError(
                f"step {step} is not newer than the last saved or loaded step "
                f"{self._last_step}: steps of one manager must increase"
            )
        goes_durable = (
            durable
            if durable is not None
            else self._saves_since_durable + 1 >= self.options.durable_every
        )
        started = time.perf_counter()
        _telemetry.prepare_save(
            "tiered", **{_telemetry.STEP: step, "resilient_ckpt.durable": goes_durable}
        )
        step_dir = memory_step_dir(self.memory_dir, self.rank, step)
        remove_step(step_dir)  # a stale save of this step from an abandoned run
        writer = open_memory_writer(step_dir, self.options)
        durable_writer = (
            open_durable_writer(self.durable_dir, step, self.rank, self.options)
            if goes_durable
            else None
        )
        _, metadata, dist_wrapper = save_state_dict_async_plan(
            plain_state(state_dict), writer, enable_cache=True, metadata_cache=self._cache
        )
        memory_job, preload_fn, args = split_save_function(writer)
        finalize_fns: list[Callable[[], None]] = []
        durable_job = None
        if durable_writer is not None:
            durable_writer.adopt(memory_job, args[1] if len(args) > 1 else [])
            durable_job = durable_job_of(durable_writer)
            durable_md = copy.copy(metadata) if metadata is not None else None
            finalize_fns.append(
                functools.partial(
                    self._commit_durable, durable_writer, durable_md, dist_wrapper, step
                )
            )
        planned = time.perf_counter()
        async_fn = None
        if memory_job is not None:
            async_fn = functools.partial(write_tiers, memory_job, durable_job)
        request = self._background_request(
            AsyncRequest(async_fn, tuple(args), finalize_fns, preload_fn=preload_fn)
        )
        call_idx = self._queue.schedule_async_request(request)
        staged = time.perf_counter()
        memory = MemorySave(
            step,
            step_dir,
            memory_job,
            metadata,
            writer.storage_meta(),
            reports=self._queue.reports_of(call_idx),
        )
        memory.span = _telemetry.span_of(self._queue.persistent_caller, call_idx)
        self._replicator.submit(memory)
        self._pending.append(PendingSave(step, call_idx, memory, goes_durable))
        self._last_step = step
        self._saves_since_durable = 0 if goes_durable else self._saves_since_durable + 1
        self.timings[step] = {"plan": planned - started, "stage": staged - planned}
        self._phase(TieredPhase.STAGED, step)

    def _background_request(self, request: AsyncRequest) -> AsyncRequest:
        """Hook for the fault kit: the request the worker runs (unchanged here)."""
        return request

    def _commit_durable(
        self, writer: DurableCopyWriter, metadata: Any, dist_wrapper: Any, step: int
    ) -> None:
        commit_durable(writer, metadata, dist_wrapper, step)
        self._phase(TieredPhase.DURABLE_COMMITTED, step)
        if self.rank == 0:
            prune_checkpoints(self.durable_dir, self.options.keep_durable)

    # -- shutdown ---------------------------------------------------------------------------

    def close(self, abort: bool = False) -> None:
        """Finalize pending saves (collective; ``abort``: drop them) and stop the background.

        A failure of a pending save is raised after everything has been stopped.
        """
        if self._closed:
            return
        error: BaseException | None = None
        if not abort and self._pending:
            try:
                self.maybe_finalize(blocking=True)
            except BaseException as exc:
                error = exc
        self._closed = True
        try:
            self._queue.close(abort=abort or error is not None)
        except BaseException as exc:
            error = error or exc
        self._replicator.close(self.timeouts.shutdown)
        if error is not None:
            raise error

    def _check_open(self) -> None:
        if self._closed:
            raise QueueClosedError("this TieredCheckpointManager is closed; create a new one")

    @property
    def queue(self) -> AsyncCallsQueue:
        """The async queue whose persistent worker writes both tiers (for the fault kit)."""
        return self._queue
