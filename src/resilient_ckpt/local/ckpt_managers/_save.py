"""Saving local checkpoints: ``save``, its three paths and its commit (see ``base_manager``).

Every rank checks the request and the outcomes are agreed before anything is written.
Then one of three paths: a synchronous save writes (and replicates) inline; an async save
without replication, or with replication over a non-gloo group, hands the write to an
``AsyncRequest`` (the exchange, a collective, happens first in the trainer); an async
replicated save over gloo snapshots into a reusable buffer and exchanges and writes in a
trainer thread (``.._background``). The finalize function commits on every rank once all
writes succeeded, or abandons the iteration and removes its files.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ... import _dist
from ..._logging import get_logger
from ...async_ckpt._deferred import DeferredList, resolved
from ...async_ckpt.core import AsyncCallsQueue, AsyncRequest
from ...config import default_timeouts
from ...errors import (
    CheckpointingException,
    ConfigurationError,
    SameMachineReplicationException,
)
from ...utils import debug_time
from .._agreement import agree, agree_number
from .._background import clique_for_background, wait_for_status, write_status
from .._format import (
    ShardBuffer,
    ShardLayout,
    crc_of,
    plan_shard,
    serialize,
    write_into,
)
from .._writer import Source, on_host
from ..base_state_dict import TensorAwareStateDict
from ..replication.strategies import ReplicationStrategy
from ._manager_base import CkptID, ManagerBase

logger = get_logger(__name__)


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


def _on_host_resolved(sources: list[Source]) -> list[Source]:
    """``preload_fn`` of a deferred save: plan it if staging did not (the fork queue), then
    ``on_host`` (in the worker, it gets the staged sources as a plain list)."""
    return on_host(resolved(sources))


def _check_iteration(iteration: Any) -> None:
    if not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < 0:
        raise ConfigurationError(f"iteration must be an int >= 0, got {iteration!r}")


def _shard_bytes(state: TensorAwareStateDict) -> ShardBuffer:
    """A copy to write: received shards as they are, other states serialized."""
    return state if isinstance(state, ShardBuffer) else ShardBuffer(serialize(plan_shard(state)))


class SaveSteps(ManagerBase):
    """``save`` of :class:`~.base_manager.BaseCheckpointManager`, with its commit."""

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
        return self._shard_cache.plan(state_dict, plan_shard)

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
            return self._deferred_request(state_dict, iteration)
        started = time.perf_counter()
        layout, iterations = agree_number(
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

    def _deferred_request(self, state_dict: Any, iteration: Any) -> AsyncRequest:
        """An async save whose preparation (the checks and the layout, agreed across
        ranks) runs where its request is staged: in overlapped staging on the staging
        thread, its agreement on the library's background group (see
        :mod:`resilient_ckpt.async_ckpt._deferred`). Its sources fill in then."""
        _check_iteration(iteration)  # here too: the request's targets are named by it
        group = _dist.background_group() if _dist.is_distributed() else None
        self.latest_iteration = -1
        self._drop_cache()
        my_id = self._ckpt_id(iteration)
        write_fn, targets = self._write_request(iteration, [my_id])

        def complete() -> None:
            layout, iterations = agree_number(
                "local checkpoint save",
                lambda: self._prepare(state_dict, iteration),
                iteration,
                group=group,
            )
            if len(set(iterations)) != 1:
                raise ConfigurationError(f"ranks save different iterations: {iterations}")
            self._inflight.add(iteration)
            sources.fill([layout])

        sources = DeferredList(complete, f"local checkpoint {iteration}")
        finalize = functools.partial(self._finalize_save, iteration)
        preload = functools.partial(_on_host_resolved, sources)
        return AsyncRequest(write_fn, (targets, sources), [finalize], preload_fn=preload)

    def warmup(
        self, state_dict: TensorAwareStateDict, queue: AsyncCallsQueue | None = None
    ) -> None:
        """Prepare this rank for saving ``state_dict``'s structure, so the first save costs
        what a steady one does; writes nothing. Collective, like ``save``: every rank calls
        it (it creates the library's process group the saves agree on).

        Lays the shard out (cached: the next save of this structure reuses it) and, for
        replicated saves, pre-faults the snapshot buffer. With ``queue`` (the one the async
        saves are scheduled on) it also starts its worker and copy threads, pre-faults an
        arena for the shard's tensors and primes its staging cache with them.
        """
        _require_tensor_aware(state_dict, "warmup")
        if _dist.is_distributed():
            _dist.library_group()
        layout = self._shard_cache.plan(state_dict, plan_shard)
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
        # Timed under NVRx's name: its tests and users' log tooling read the DEBUG line
        # "finalize_fn took <seconds>s" of every save's finalize.
        with debug_time("finalize_fn", logger):
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
