"""``BaseCheckpointManager``: the protocol of local checkpoints, independent of storage.

Public methods own the invariants and are collective (every rank, in the trainer); a
subclass implements the storage ``_hooks``, as :class:`~.local_manager.LocalCheckpointManager`
does for files.

* **Agree before acting.** ``save`` checks the request on every rank (a TensorAwareStateDict,
  an iteration newer than any known, writable storage, a picklable non-tensor part) and
  agrees the outcomes (:func:`..._dist.run_agreed`): a bad request fails everywhere with its cause
  instead of leaving the others waiting in the exchange.
* **Three save paths, one commit.** Synchronous: replicate and write inline. Async: an
  ``AsyncRequest`` whose queue snapshots the tensors; replicated over a non-gloo group, the
  exchange (a collective) runs first, in the trainer. Async replicated over gloo: the shard is
  serialized into one reusable buffer (the snapshot), exchanged and written in a trainer
  thread (:mod:`.._background`). All end in one finalize: once every rank's writes succeeded,
  each renames its dirty files (the commit) and retention runs in the background
  (:mod:`.._deleter`); if any rank failed, every rank removes the iteration's files.
* **find_latest verifies in at most two agreed rounds.** Newest first, an iteration is
  complete when each shard has a copy somewhere whose checksum verifies. Round one: each rank
  its own copy (the read pre-loads it for ``load``) and replicas of owners that hold none,
  forwarded to the owner as they are read (:mod:`..replication._forward`); round two, only for
  a shard still without one, its other replicas. A corrupt file is logged and treated as
  missing; newer incomplete iterations and dirty leftovers are deleted (they never complete).
* **load moves only what is missing.** The strategy plans who sends which shard; the bytes
  travel as one buffer per transfer, are checked against the sender's manifest, and the state
  is rebuilt with tensors as views of that buffer, then moved back to its devices.
"""

from __future__ import annotations

import functools
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ... import _dist, _telemetry
from ..._logging import get_logger
from ...async_ckpt._staging import PlanStep
from ...async_ckpt.core import AsyncCallsQueue, AsyncRequest
from ...config import default_timeouts
from ...errors import (
    CheckpointingException,
    ConfigurationError,
    CorruptCheckpointError,
    SameMachineReplicationException,
)
from ...utils import debug_time
from .. import _format, _nvrx_format
from .._background import (
    BackgroundSaves,
    clique_for_background,
    wait_for_status,
    write_status,
)
from .._format import (
    ShardBuffer,
    ShardLayout,
    crc_of,
    deserialize,
    serialize,
    write_into,
)
from .._manifest import CopyInfo
from .._shard_cache import ShardPlanCache, plan_shard
from .._writer import Source, on_host
from ..base_state_dict import TensorAwareStateDict
from ..replication import _chunked, _forward
from ..replication.group_utils import CliqueGroup
from ..replication.strategies import ReplicationStrategy
from . import _catalogue

__all__ = [
    "BaseCheckpointManager",
    "CheckpointingException",
    "CkptID",
    "SameMachineReplicationException",
]

logger = get_logger(__name__)

CkptID = tuple[int, int, Any]
"""A checkpoint id: ``(iteration, owner rank, session_id)``."""


def _as_ckpt_id(value: Hashable) -> CkptID:
    if not isinstance(value, tuple) or len(value) != 3:
        raise CheckpointingException(f"replication returned a malformed checkpoint id {value!r}")
    return (int(value[0]), int(value[1]), value[2])


def _require_tensor_aware(state_dict: Any, method: str) -> None:
    if not isinstance(state_dict, TensorAwareStateDict):
        raise ConfigurationError(
            f"{method}() needs a TensorAwareStateDict, got {type(state_dict).__name__}; wrap "
            "a plain state dict in BasicTensorAwareStateDict"
        )


def _check_iteration(iteration: Any) -> None:
    if not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < 0:
        raise ConfigurationError(f"iteration must be an int >= 0, got {iteration!r}")


def _shard_bytes(state: TensorAwareStateDict) -> ShardBuffer:
    """A copy to write: received shards as they are, other states serialized."""
    return state if isinstance(state, ShardBuffer) else ShardBuffer(serialize(plan_shard(state)))


class _Forwarding:
    """This rank's part in one verification round's forwards (``replication._forward``):
    the replicas it verifies while sending them on, and the receive of its own lost shard."""

    def __init__(
        self,
        rank: int,
        iteration: int,
        plan: dict[int, tuple[int, CopyInfo]],
        clique: CliqueGroup,
    ) -> None:
        self.rank, self.iteration, self.clique = rank, iteration, clique
        # Only within this rank's clique, the group the chunks travel in: both ends see
        # the same (cliques partition the ranks), so a pair outside one acts on neither.
        members = set(clique.ranks)
        self.receivers = {
            copy.path: owner
            for owner, (sender, copy) in plan.items()
            if sender == rank and owner in members
        }
        mine = plan.get(rank)
        self.mine = mine if mine is not None and mine[0] in members else None
        self.incoming: _chunked.IncomingBuffer | None = None

    def post_receive(self) -> None:
        """Post the receive of this rank's shard if a peer forwards it (before verifying)."""
        if self.mine is not None:
            sender, copy = self.mine
            self.incoming = _forward.expect(copy, sender, self.clique)

    def bind(self, try_verify: Any) -> Any:
        """``try_verify`` that forwards the copies this rank sends on as it verifies them."""

        def check(copy: CopyInfo) -> bool:
            receiver = self.receivers.get(copy.path)
            if receiver is None:
                return bool(try_verify(copy))
            return bool(try_verify(copy, read=lambda c: _forward.forward(c, receiver, self.clique)))

        return check

    def receive(self, verified: dict[CkptID, torch.Tensor], ckpt_id: CkptID) -> bool:
        """Wait for this rank's forwarded shard; keep it as ``ckpt_id`` if it verifies."""
        if self.incoming is None or self.mine is None:
            return False
        sender, copy = self.mine
        buffer = _forward.received(self.incoming, copy, sender)
        self.incoming = None
        if buffer is None:
            return False
        verified[ckpt_id] = buffer
        return True


class BaseCheckpointManager(ABC):
    """Local checkpoints of one rank's state, with optional replication (NVRx API).

    The public methods (``save``, ``find_latest``, ``load``; all collective) own the
    protocol; a subclass implements the abstract storage hooks.

    Trust: ``load`` unpickles the state's non-tensor part freely, as NVRx does
    (``torch.load(weights_only=False)``), because NVRx and Megatron keep arbitrary objects
    there: anyone who can write the storage can run code in the job. ``weights_only=True`` is
    the safe mode, for storage others can write: plain values, this format's classes and the
    user's ``torch.serialization`` safe globals are allowed; anything else is refused on every
    rank with :class:`~resilient_ckpt.errors.UnsafeCheckpointError` naming file and global.
    """

    def __init__(
        self,
        session_id: Any,
        repl_strategy: ReplicationStrategy | None = None,
        *,
        weights_only: bool = False,
    ) -> None:
        if repl_strategy is not None and not isinstance(repl_strategy, ReplicationStrategy):
            raise ConfigurationError(
                f"repl_strategy must be a ReplicationStrategy or None, got {repl_strategy!r}"
            )
        if not isinstance(weights_only, bool):
            raise ConfigurationError(f"weights_only must be a bool, got {weights_only!r}")
        self.weights_only = weights_only
        self.latest_iteration = -1
        self.repl_strategy = repl_strategy
        # Async saves without replication prepare at staging (see save).
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
        """This process's rank in the job (0, with a warning, without a process group)."""
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

    # -- save -------------------------------------------------------------------------------

    def save(
        self, state_dict: TensorAwareStateDict, iteration: int, is_async: bool = False
    ) -> AsyncRequest | None:
        """Save this rank's ``state_dict`` as ``iteration``; collective.

        Returns an :class:`AsyncRequest` to schedule on an ``AsyncCallsQueue`` (persistent
        or fork) when ``is_async``; else writes, commits and returns None. With
        ``defer_planning`` (an async save without a replication strategy) the checks, the
        layout and their agreement run when that request is staged instead of here.
        """
        if is_async and self.defer_planning and self.repl_strategy is None:
            request = self._deferred_request(state_dict, iteration)
            _telemetry.prepare_save("local", **{_telemetry.STEP: iteration})
            return request
        started = time.perf_counter()
        layout, iterations = _dist.run_agreed_int(
            "local checkpoint save", lambda: self._prepare(state_dict, iteration), iteration
        )
        if len(set(iterations)) != 1:
            raise ConfigurationError(f"ranks save different iterations: {iterations}")
        self.latest_iteration = -1
        self._drop_cache()
        my_id = self._ckpt_id(iteration)
        self._inflight.add(iteration)
        finalize = functools.partial(self._finalize_save, iteration)
        background = clique_for_background(self.repl_strategy) if is_async else None
        if background is not None:
            request = self._background_request(background, layout, my_id, finalize)
            logger.info(
                "local checkpoint %d: snapshot of %d bytes in %.3fs, replication in background",
                iteration,
                layout.size,
                time.perf_counter() - started,
            )
            _telemetry.prepare_save("local", **{_telemetry.STEP: iteration})
            return request
        self._background.drain(default_timeouts().finalize)
        if is_async:
            sources, ckpt_ids = self._copies(layout, my_id)
            write_fn, targets = self._write_request(iteration, ckpt_ids)
            preload = functools.partial(on_host, sources)
            _telemetry.prepare_save("local", **{_telemetry.STEP: iteration})
            return AsyncRequest(write_fn, (targets, sources), [finalize], preload_fn=preload)
        self._save_now(layout, my_id)
        finalize()
        logger.info("local checkpoint %d saved in %.3fs", iteration, time.perf_counter() - started)
        return None

    def warmup(
        self, state_dict: TensorAwareStateDict, queue: AsyncCallsQueue | None = None
    ) -> None:
        """Prepare for saving ``state_dict``'s structure so the first save costs what a steady
        one does; writes nothing. Collective, like ``save`` (it creates the library's group).

        Lays the shard out (reused by the next save of this structure) and, replicated,
        pre-faults the snapshot buffer. With ``queue`` (the one async saves go to) it also
        starts its worker and primes its staging for the shard's tensors.
        """
        _require_tensor_aware(state_dict, "warmup")
        if _dist.is_distributed():
            _dist.library_group()
        layout = plan_shard(state_dict, self._shard_cache)
        if self.repl_strategy is not None:
            if clique_for_background(self.repl_strategy) is not None:
                buffer = self._background.acquire(layout.size, default_timeouts().finalize)
                buffer.fill_(0)  # first touch now, not during the first snapshot
                self._background.release(buffer)
            if queue is not None:
                queue.warmup()  # the request stages received shards, unknown until then
        elif queue is not None:
            # What an unreplicated async save stages: the layout's tensors, in order.
            queue.warmup([layout])

    def _prepare(self, state_dict: Any, iteration: Any) -> ShardLayout:
        _require_tensor_aware(state_dict, "save")
        _check_iteration(iteration)
        newest = max(self._newest_saved, self.latest_iteration, *self._inflight)
        if iteration <= newest:
            raise ConfigurationError(
                f"iteration {iteration} is not newer than the latest local checkpoint "
                f"({newest}); iterations must increase"
            )
        self._prepare_save(iteration)
        return plan_shard(state_dict, self._shard_cache)

    def _deferred_request(self, state_dict: Any, iteration: Any) -> AsyncRequest:
        """An async save whose checks and layout (agreed on the background group) run where
        its request is staged: its ``preload_fn`` is that planning
        (:class:`resilient_ckpt.async_ckpt._staging.PlanStep`), its sources None until then."""
        _check_iteration(iteration)  # here too: the request's targets are named by it
        group = _dist.background_group() if _dist.is_distributed() else None
        self.latest_iteration = -1
        self._drop_cache()
        my_id = self._ckpt_id(iteration)
        write_fn, targets = self._write_request(iteration, [my_id])

        def plan() -> list[Source]:
            layout, iterations = _dist.run_agreed_int(
                "local checkpoint save",
                lambda: self._prepare(state_dict, iteration),
                iteration,
                group=group,
            )
            if len(set(iterations)) != 1:
                raise ConfigurationError(f"ranks save different iterations: {iterations}")
            self._inflight.add(iteration)
            return [layout]

        step = PlanStep(plan, on_host, f"local checkpoint {iteration}")
        finalize = functools.partial(self._finalize_save, iteration)
        return AsyncRequest(write_fn, (targets, None), [finalize], preload_fn=step)

    def _save_now(self, layout: ShardLayout, my_id: CkptID) -> None:
        """Replicate (if configured) and write every copy, agreed across ranks."""
        strategy = self.repl_strategy
        try:
            if strategy is None:
                write_fn, targets = self._write_request(my_id[0], [my_id])
                _dist.run_agreed("local checkpoint write", lambda: write_fn(targets, [layout]))
                return
            buffer = self._background.acquire(layout.size, default_timeouts().finalize)
            try:
                write_into(layout, buffer)
                own = ShardBuffer(buffer, crc_of(buffer))
                _dist.run_agreed(
                    "local checkpoint write",
                    lambda: self._exchange_and_write(strategy, own, my_id),
                )
            finally:
                self._background.release(buffer)
        except CheckpointingException:
            self._abandon(my_id[0])
            raise

    def _exchange_and_write(
        self, strategy: ReplicationStrategy, own: ShardBuffer, my_id: CkptID
    ) -> None:
        """Replicate ``own`` and write every copy; this rank's own copy is written while
        the exchange runs (disk and network in parallel)."""
        iteration = my_id[0]
        write_fn, own_target = self._write_request(iteration, [my_id])
        with ThreadPoolExecutor(1, "resilient_ckpt-own-copy") as pool:
            own_written = pool.submit(write_fn, own_target, [own])
            states, ids = strategy.replicate(own, my_id)
            ckpt_ids = [_as_ckpt_id(i) for i in ids]
            if len(set(ckpt_ids)) != len(ckpt_ids) or my_id not in ckpt_ids:
                raise SameMachineReplicationException(my_id)
            write_fn, targets = self._write_request(iteration, ckpt_ids)
            peers = [(t, s) for t, s in zip(targets, states, strict=True) if t.ckpt_id != my_id]
            write_fn([t for t, _ in peers], [_shard_bytes(s) for _, s in peers])
            own_written.result()

    def _background_request(
        self,
        strategy: ReplicationStrategy,
        layout: ShardLayout,
        my_id: CkptID,
        finalize: Callable[[], None],
    ) -> AsyncRequest:
        """Snapshot now; exchange and write in the trainer thread (see ``.._background``)."""
        iteration = my_id[0]
        buffer = self._background.acquire(layout.size, default_timeouts().finalize)
        try:
            write_into(layout, buffer)
        except BaseException:
            self._background.release(buffer)
            raise
        status = self._status_path(iteration)
        job = functools.partial(self._replicate_and_write, strategy, buffer, my_id, status)
        self._background.submit(job)
        return AsyncRequest(wait_for_status, (status, default_timeouts().finalize), [finalize])

    def _replicate_and_write(
        self, strategy: ReplicationStrategy, buffer: torch.Tensor, my_id: CkptID, status: str
    ) -> None:
        error: BaseException | None = None
        try:
            self._exchange_and_write(strategy, ShardBuffer(buffer, crc_of(buffer)), my_id)
        except BaseException as exc:
            error = exc
            logger.error("replicated save of %s failed: %s", my_id, exc)
            # Before the verdict is written: on a full disk the copies written so far hold
            # the space the status file needs, and a missing verdict is only noticed at the
            # finalize deadline.
            self._free_failed_copies(my_id[0])
            raise
        finally:
            self._background.release(buffer)
            write_status(status, error, sync=False)

    def _copies(self, layout: ShardLayout, my_id: CkptID) -> tuple[list[Source], list[CkptID]]:
        """What an async save's worker writes: this rank's layout or, replicated (inline
        exchange), every clique member's serialized shard."""
        if self.repl_strategy is None:
            return [layout], [my_id]
        buffer = serialize(layout)
        states, ids = self.repl_strategy.replicate(ShardBuffer(buffer, crc_of(buffer)), my_id)
        sources: list[Source] = [_shard_bytes(s) for s in states]
        return sources, [_as_ckpt_id(i) for i in ids]

    def _finalize_save(self, iteration: int) -> None:
        # Timed under NVRx's name: its tests and users' log tooling read the DEBUG line
        # "finalize_fn took <seconds>s" of every save's finalize.
        with debug_time("finalize_fn", logger):
            try:
                _dist.run_agreed(
                    f"commit of local checkpoint {iteration}", lambda: self._commit(iteration)
                )
            except CheckpointingException:
                self._abandon(iteration)
                raise
            # The queue finalizes in order: an older save not finalized by now has failed.
            self._inflight = {i for i in self._inflight if i > iteration}
            self._newest_saved = max(self._newest_saved, iteration)
            self.latest_iteration = -1
            self._cleanup(iteration)
        logger.info("committed local checkpoint iteration %d", iteration)

    def _abandon(self, iteration: int) -> None:
        self._inflight.discard(iteration)
        try:
            self._cleanup_failed_save(iteration)
        except OSError as exc:
            logger.warning("could not remove files of failed save %d: %s", iteration, exc)

    # -- find_latest and load ---------------------------------------------------------------

    def find_latest(self) -> int:
        """The newest iteration whose every shard has a valid copy somewhere, or -1.

        Cached until the next save (so the usual ``find_latest(); load()`` reads once).
        All ranks call it at once.
        """
        if self.latest_iteration != -1:
            return self.latest_iteration
        started = time.perf_counter()
        self._background.drain(default_timeouts().finalize)
        self._drop_cache()
        # Each rank's replication setup travels with its catalogue: cliques may differ in
        # size (NVRx allows any partition), and a rank's copies are checked against its own.
        scans = _dist.gather_agreed(
            "local checkpoint scan",
            lambda: (self._list_copies(set(self._inflight)), self._replication_params()),
        )
        catalogue = [scan[0] for scan in scans]
        self._catalogue = catalogue
        _catalogue.check_world_size(catalogue, self.world_size)
        use_replicas = self.repl_strategy is not None
        latest = -1
        for iteration in _catalogue.candidate_iterations(catalogue, self.world_size, use_replicas):
            for note in _catalogue.check_replication(
                catalogue, iteration, [scan[1] for scan in scans]
            ):
                logger.warning("%s", note)
            holders = self._verify_iteration(iteration, use_replicas)
            if holders is not None:
                latest = iteration
                self.globally_available_ids = holders
                break
        self._discard_newer(latest)
        self.latest_iteration = latest
        logger.info("find_latest: iteration %d (%.3fs)", latest, time.perf_counter() - started)
        return latest

    def _try_verify(self, copy: CopyInfo, read: Any = None) -> bool:
        try:
            buffer = (read or self._read_copy)(copy)
        except (CorruptCheckpointError, OSError) as exc:
            logger.warning("bad local checkpoint file %s, treated as missing: %s", copy.path, exc)
            return False
        self._verified[self._ckpt_id(copy.iteration, copy.owner)] = buffer
        return True

    def _first_round(self, holder: int, iteration: int, use_replicas: bool) -> list[CopyInfo]:
        """Copies ``holder`` verifies first: its own, and replicas of owners that hold none
        (decided from the catalogue alone, so every rank knows every rank's choice)."""
        copies = _catalogue.copies_of(self._catalogue, holder, iteration)
        if not use_replicas:
            return [c for c in copies if c.owner == holder]
        present = {
            r
            for r in range(self.world_size)
            if _catalogue.find_copy(self._catalogue, r, iteration, r) is not None
        }
        return [c for c in copies if c.owner == holder or c.owner not in present]

    def _verify_all(
        self, copies: list[CopyInfo], forwarding: _Forwarding | None = None
    ) -> list[int]:
        """Owners of the ``copies`` whose checksums verify (read in parallel), with this
        rank's own shard when ``forwarding`` brought it here verified."""
        if forwarding is not None:
            forwarding.post_receive()
        check = self._try_verify if forwarding is None else forwarding.bind(self._try_verify)
        if len(copies) <= 1:
            owners = [c.owner for c in copies if check(c)]
        else:
            with ThreadPoolExecutor(min(len(copies), 4), "resilient_ckpt-verify") as pool:
                results = list(pool.map(check, copies))
            owners = [c.owner for c, ok in zip(copies, results, strict=True) if ok]
        if forwarding is not None and forwarding.receive(
            self._verified, self._ckpt_id(forwarding.iteration)
        ):
            owners.append(self.rank)
        return owners

    def _forwarding(self, iteration: int, use_replicas: bool) -> _Forwarding | None:
        """The forwards of lost shards in this round (see ``replication._forward``); None
        when every owner holds its copy or the clique cannot forward."""
        if not use_replicas:
            return None
        world = self.world_size
        present = {
            r for r in range(world) if _catalogue.find_copy(self._catalogue, r, iteration, r)
        }
        if len(present) == world:
            return None
        clique = _forward.clique_for_forwarding(self.repl_strategy)
        if clique is None:
            return None
        rounds = [self._first_round(h, iteration, use_replicas) for h in range(world)]
        plan = _forward.forwards(rounds, present)
        return _Forwarding(self.rank, iteration, plan, clique) if plan else None

    def _verify_iteration(
        self, iteration: int, use_replicas: bool
    ) -> dict[int, list[CkptID]] | None:
        """Holders of a verified copy of each shard (by rank), or None if a shard has none:
        the two rounds of the module docstring."""
        me, world = self.rank, self.world_size
        first = self._first_round(me, iteration, use_replicas)
        forwarding = self._forwarding(iteration, use_replicas)
        forwarded = forwarding is not None and forwarding.mine is not None
        if use_replicas and not any(c.owner == me for c in first) and not forwarded:
            self._expect_transfer(iteration)
        verified = _dist.gather_agreed(
            "local checkpoint verification", lambda: self._verify_all(first, forwarding)
        )
        owners_by_holder: list[list[int]] = [list(v) for v in verified]
        missing = [r for r in range(world) if not any(r in v for v in verified)]
        untried = [
            [
                c
                for c in _catalogue.copies_of(self._catalogue, holder, iteration)
                if c.owner in missing
                and c not in self._first_round(holder, iteration, use_replicas)
            ]
            for holder in range(world)
        ]
        if use_replicas and any(untried):
            more = _dist.gather_agreed(
                "local checkpoint replica verification", lambda: self._verify_all(untried[me])
            )
            for holder, owners in enumerate(more):
                owners_by_holder[holder].extend(owners)
            missing = [r for r in missing if not any(r in o for o in more)]
        if missing:
            logger.warning(
                "iteration %d is not complete: no valid copy of the shard(s) of rank(s) %s",
                iteration,
                missing,
            )
            self._drop_cache()
            return None
        return {
            holder: [self._ckpt_id(iteration, owner) for owner in owners]
            for holder, owners in enumerate(owners_by_holder)
        }

    def _expect_transfer(self, iteration: int) -> None:
        """This rank holds no copy of its shard: prepare the buffer a peer will fill (while
        the peers verify what they will send; see ``replication._chunked``)."""
        for copies in self._catalogue:
            for copy in copies:
                if copy.iteration == iteration and copy.owner == self.rank:
                    _chunked.reserve(copy.size)
                    return

    def _discard_newer(self, latest: int) -> None:
        mine = self._catalogue[self.rank] if self._catalogue else []
        stale = sorted({c.iteration for c in mine if c.iteration > latest} - self._inflight)
        if stale:
            logger.warning("deleting incomplete local checkpoint iteration(s) %s", stale)
            self._discard(stale)

    def load(self) -> tuple[TensorAwareStateDict, CkptID]:
        """Load this rank's shard of the iteration ``find_latest`` found. Collective.

        The state is unpickled freely, or with the allow-list of ``weights_only=True``
        (see the class docstring).
        """
        if self.latest_iteration == -1:
            raise CheckpointingException(
                "load() needs a complete checkpoint: call find_latest() first (on every rank); "
                "it returned -1 or was not called"
            )
        started = time.perf_counter()
        self._background.drain(default_timeouts().finalize)
        my_id = self._ckpt_id(self.latest_iteration)
        try:
            if self.repl_strategy is None:
                buffer = _dist.run_agreed("local checkpoint read", lambda: self._buffer_of(my_id))
            else:
                buffer = self._retrieve(my_id)
            state = self._rebuild(buffer, my_id)
            state.restore_tensor_device(non_blocking=False)
        finally:
            self._drop_cache()
        logger.info(
            "loaded local checkpoint %s: %d bytes in %.3fs",
            my_id,
            buffer.numel(),
            time.perf_counter() - started,
        )
        return state, my_id

    def _rebuild(self, buffer: torch.Tensor, my_id: CkptID) -> TensorAwareStateDict:
        """The state from its verified shard bytes. In safe mode a refused global on one
        rank fails the load on every rank, or the job would go on with some ranks restored."""
        copy = _catalogue.find_copy(self._catalogue, self.rank, my_id[0], my_id[1])
        source = copy.path if copy is not None else f"local checkpoint {my_id} (from a peer)"
        if not self.weights_only:
            return deserialize(buffer, source=source)
        return _dist.run_agreed(
            "local checkpoint load (weights_only=True)",
            lambda: deserialize(buffer, weights_only=True, source=source),
        )

    def _buffer_of(self, ckpt_id: CkptID) -> torch.Tensor:
        cached = self._verified.get(ckpt_id)
        if cached is not None:
            return cached
        copy = _catalogue.find_copy(self._catalogue, self.rank, ckpt_id[0], ckpt_id[1])
        if copy is None:
            raise CheckpointingException(f"rank {self.rank} holds no copy of {ckpt_id}")
        return self._read_copy(copy)

    def _retrieve(self, my_id: CkptID) -> torch.Tensor:
        strategy = self.repl_strategy
        if strategy is None:
            raise CheckpointingException("no replication strategy")
        plan = strategy.retrieve_plan(self.globally_available_ids, [my_id])
        my_data: dict[Hashable, TensorAwareStateDict] = _dist.run_agreed(
            "local checkpoint read of copies to send",
            lambda: {i: ShardBuffer(self._buffer_of(i)) for i in plan.required_ids()},  # type: ignore[arg-type]
        )
        received = strategy.retrieve_execute(plan, my_data)
        shard = received[my_id]
        buffer = shard.data if isinstance(shard, ShardBuffer) else serialize(plan_shard(shard))
        sender = next(e.sender for e in plan.entries if e.receiver == self.rank and e.id_ == my_id)
        if sender != self.rank:
            arrived = shard.arrived_crc32 if isinstance(shard, ShardBuffer) else None
            self._check_received(buffer, sender, my_id, arrived)
        return buffer

    def _check_received(
        self, buffer: torch.Tensor, sender: int, ckpt_id: CkptID, arrived: int | None = None
    ) -> None:
        """Compare the received bytes with the sender's manifest; ``arrived`` is their CRC-32
        measured during the transfer (None: compute it here)."""
        copy = _catalogue.find_copy(self._catalogue, sender, ckpt_id[0], ckpt_id[1])
        if copy is not None and copy.nvrx:
            _nvrx_format.verify(_format.bytes_view(buffer), f"copy of {ckpt_id} from rank {sender}")
        elif copy is not None and (crc_of(buffer) if arrived is None else arrived) != copy.crc32:
            raise CorruptCheckpointError(
                f"copy of {ckpt_id} received from rank {sender} does not match its checksum"
            )
        logger.info("received shard %s from rank %d (%d bytes)", ckpt_id, sender, buffer.numel())

    def _drop_cache(self) -> None:
        self._verified.clear()
        _chunked.release_reserved()

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
