"""``BaseCheckpointManager``: the protocol of local checkpoints, independent of storage.

Public methods own the invariants; a subclass implements the storage ``_hooks`` (listing,
reading and verifying copies, the write function, commit, retention). Every public method
is collective: all ranks call it at once, in the trainer.

* ``save(state, iteration, is_async)``: every rank checks the request locally (a
  TensorAwareStateDict, an iteration newer than any known, a writable directory, a
  picklable non-tensor part) and the outcomes are agreed, so a bad request fails on every
  rank with the cause instead of hanging the others. The shard is laid out once. Without
  replication, writing it is the ``async_fn`` of an
  :class:`~resilient_ckpt.async_ckpt.core.AsyncRequest` that runs on the persistent queue
  (which snapshots the tensors into shared memory) and on the fork queue (which snapshots
  by forking, after ``preload_fn`` moved device tensors to the host). With replication the
  shard is serialized into one flat buffer (the snapshot) and exchanged with the clique,
  which is a collective and so happens in the trainer: in a trainer thread for async saves
  over gloo (the request's ``async_fn`` waits for that thread, see ``.._background``),
  inline otherwise. The finalize function commits: once every rank's writes succeeded,
  each rank renames its dirty files to their final names, and retention removes older
  iterations (in the background, see ``.._deleter``). A synchronous save runs the same
  steps inline.
* ``find_latest()``: all ranks gather the catalogue of committed copies. Newest first, an
  iteration is complete when every rank's shard has a copy whose checksum verifies: each
  rank verifies its own copy (reading it, which also pre-loads it for ``load``); for
  shards whose owner has no valid copy, the holders of replicas verify theirs. A corrupt
  file is logged by path and treated as missing. Newer iterations that are not complete are
  deleted (they can never become complete), as are dirty leftovers of interrupted saves.
* ``load()``: the strategy plans who sends which shard (only ranks without a valid copy
  of their own receive one), the verified bytes move as one buffer per transfer, and the
  state is rebuilt with its tensors as views of that buffer, then moved back to the
  devices it came from.
"""

from __future__ import annotations

import functools
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from ... import _dist
from ..._logging import get_logger
from ...async_ckpt.core import AsyncRequest
from ...config import default_timeouts
from ...errors import (
    CheckpointingException,
    ConfigurationError,
    CorruptCheckpointError,
    SameMachineReplicationException,
)
from .._agreement import agree, agree_gather
from .._background import BackgroundSaves, clique_for_background, wait_for_status, write_status
from .._format import (
    ShardBuffer,
    ShardLayout,
    crc_of,
    deserialize,
    plan_shard,
    serialize,
    write_into,
)
from .._manifest import CopyInfo
from .._writer import Source, on_host
from ..base_state_dict import TensorAwareStateDict
from ..replication import _chunked
from ..replication.strategies import ReplicationStrategy
from . import _catalogue

logger = get_logger(__name__)

__all__ = [
    "BaseCheckpointManager",
    "CheckpointingException",
    "CkptID",
    "SameMachineReplicationException",
]

CkptID = tuple[int, int, Any]


def _as_ckpt_id(value: Hashable) -> CkptID:
    if not isinstance(value, tuple) or len(value) != 3:
        raise CheckpointingException(f"replication returned a malformed checkpoint id {value!r}")
    return (int(value[0]), int(value[1]), value[2])


def _shard_bytes(state: TensorAwareStateDict) -> ShardBuffer:
    """A copy to write: received shards as they are, other states serialized."""
    return state if isinstance(state, ShardBuffer) else ShardBuffer(serialize(plan_shard(state)))


class BaseCheckpointManager(ABC):
    """Local checkpoints of one rank's state, with optional replication (NVRx API)."""

    def __init__(self, session_id: Any, repl_strategy: ReplicationStrategy | None = None) -> None:
        if repl_strategy is not None and not isinstance(repl_strategy, ReplicationStrategy):
            raise ConfigurationError(
                f"repl_strategy must be a ReplicationStrategy or None, got {repl_strategy!r}"
            )
        self.latest_iteration = -1
        self.repl_strategy = repl_strategy
        self.session_id = session_id
        self._rank: int | None = None
        self.globally_available_ids: dict[int, list[CkptID]] = {}
        self._catalogue: list[list[CopyInfo]] = []
        self._verified: dict[CkptID, torch.Tensor] = {}
        self._inflight: set[int] = set()
        self._newest_saved = -1
        self._background = BackgroundSaves()

    @property
    def rank(self) -> int:
        if self._rank is None:
            if not _dist.has_process_group():
                logger.warning("torch.distributed is not initialised; using rank 0")
            self._rank = _dist.rank()
        return self._rank

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

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

    # -- find_latest ------------------------------------------------------------------------

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
        _, catalogue = agree_gather(
            "local checkpoint scan", lambda: (None, self._list_copies(set(self._inflight)))
        )
        self._catalogue = catalogue
        _catalogue.check_world_size(catalogue, self.world_size)
        use_replicas = self.repl_strategy is not None
        latest = -1
        for iteration in _catalogue.candidate_iterations(catalogue, self.world_size, use_replicas):
            for note in _catalogue.check_replication(
                catalogue, iteration, self._replication_params()
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

    def _try_verify(self, copy: CopyInfo) -> bool:
        try:
            buffer = self._read_copy(copy)
        except (CorruptCheckpointError, OSError) as exc:
            logger.warning("bad local checkpoint file %s, treated as missing: %s", copy.path, exc)
            return False
        self._verified[self._ckpt_id(copy.iteration, copy.owner)] = buffer
        return True

    def _first_round(self, holder: int, iteration: int, use_replicas: bool) -> list[CopyInfo]:
        """Copies ``holder`` verifies first: its own, and replicas of owners that hold none.

        Decided from the catalogue alone, so every rank knows every rank's choice. After a
        node loss this reads the lost shards at once, in parallel with the holder's own.
        """
        copies = _catalogue.copies_of(self._catalogue, holder, iteration)
        if not use_replicas:
            return [c for c in copies if c.owner == holder]
        present = {
            r
            for r in range(self.world_size)
            if _catalogue.find_copy(self._catalogue, r, iteration, r) is not None
        }
        return [c for c in copies if c.owner == holder or c.owner not in present]

    def _verify_all(self, copies: list[CopyInfo]) -> list[int]:
        """Owners of the ``copies`` whose checksums verify (read in parallel)."""
        if len(copies) <= 1:
            return [c.owner for c in copies if self._try_verify(c)]
        with ThreadPoolExecutor(min(len(copies), 4), "resilient_ckpt-verify") as pool:
            results = list(pool.map(self._try_verify, copies))
        return [c.owner for c, ok in zip(copies, results, strict=True) if ok]

    def _verify_iteration(
        self, iteration: int, use_replicas: bool
    ) -> dict[int, list[CkptID]] | None:
        """Holders of a verified copy of each shard (by rank), or None if a shard has none.

        Round one verifies the copies of :meth:`_first_round`; a second round, only if some
        shard is still without a verified copy (a corrupt owner copy), verifies the other
        replicas of those shards.
        """
        me, world = self.rank, self.world_size
        first = self._first_round(me, iteration, use_replicas)
        if use_replicas and not any(c.owner == me for c in first):
            self._expect_transfer(iteration)
        _, verified = agree_gather(
            "local checkpoint verification", lambda: (None, self._verify_all(first))
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
            _, more = agree_gather(
                "local checkpoint replica verification",
                lambda: (None, self._verify_all(untried[me])),
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

    def _drop_cache(self) -> None:
        self._verified.clear()
        _chunked.release_reserved()

    # -- load -------------------------------------------------------------------------------

    def load(self) -> tuple[TensorAwareStateDict, CkptID]:
        """Load this rank's shard of the iteration ``find_latest`` found. Collective."""
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
                buffer = agree("local checkpoint read", lambda: self._buffer_of(my_id))
            else:
                buffer = self._retrieve(my_id)
            state = deserialize(buffer)
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
        my_data: dict[Hashable, TensorAwareStateDict] = agree(
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
        """Compare the received bytes' CRC (``arrived``: measured during the transfer)
        with the sender's manifest."""
        copy = _catalogue.find_copy(self._catalogue, sender, ckpt_id[0], ckpt_id[1])
        if copy is not None and (crc_of(buffer) if arrived is None else arrived) != copy.crc32:
            raise CorruptCheckpointError(
                f"copy of {ckpt_id} received from rank {sender} does not match its checksum"
            )
        logger.info("received shard %s from rank %d (%d bytes)", ckpt_id, sender, buffer.numel())

    # -- save -------------------------------------------------------------------------------

    def _prepare(self, state_dict: Any, iteration: Any) -> ShardLayout:
        if not isinstance(state_dict, TensorAwareStateDict):
            raise ConfigurationError(
                f"save() needs a TensorAwareStateDict, got {type(state_dict).__name__}; wrap "
                "a plain state dict in BasicTensorAwareStateDict"
            )
        if not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < 0:
            raise ConfigurationError(f"iteration must be an int >= 0, got {iteration!r}")
        newest = max(self._newest_saved, self.latest_iteration, *self._inflight)
        if iteration <= newest:
            raise ConfigurationError(
                f"iteration {iteration} is not newer than the latest local checkpoint "
                f"({newest}); iterations must increase"
            )
        self._prepare_save(iteration)
        return plan_shard(state_dict)

    def save(
        self, state_dict: TensorAwareStateDict, iteration: int, is_async: bool = False
    ) -> AsyncRequest | None:
        """Save this rank's ``state_dict`` as ``iteration``; collective.

        Returns an :class:`AsyncRequest` to schedule on an ``AsyncCallsQueue`` (persistent
        or fork) when ``is_async``; else writes, commits and returns None.
        """
        started = time.perf_counter()
        layout, iterations = agree_gather(
            "local checkpoint save", lambda: (self._prepare(state_dict, iteration), iteration)
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
            return request
        self._background.drain(default_timeouts().finalize)
        if is_async:
            sources, ckpt_ids = self._copies(layout, my_id)
            write_fn, targets = self._write_request(iteration, ckpt_ids)
            preload = functools.partial(on_host, sources)
            return AsyncRequest(write_fn, (targets, sources), [finalize], preload_fn=preload)
        self._save_now(layout, my_id)
        finalize()
        logger.info("local checkpoint %d saved in %.3fs", iteration, time.perf_counter() - started)
        return None

    def _save_now(self, layout: ShardLayout, my_id: CkptID) -> None:
        """Replicate (if configured) and write every copy, agreed across ranks."""
        strategy = self.repl_strategy
        try:
            if strategy is None:
                write_fn, targets = self._write_request(my_id[0], [my_id])
                agree("local checkpoint write", lambda: write_fn(targets, [layout]))
                return
            buffer = self._background.acquire(layout.size, default_timeouts().finalize)
            try:
                write_into(layout, buffer)
                own = ShardBuffer(buffer, crc_of(buffer))
                agree(
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
        try:
            agree(f"commit of local checkpoint {iteration}", lambda: self._commit(iteration))
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
