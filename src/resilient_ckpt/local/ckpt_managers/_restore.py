"""Restoring local checkpoints: ``find_latest`` and ``load`` (see ``base_manager``).

``find_latest`` gathers every rank's catalogue of committed copies and, newest iteration
first, verifies in at most two agreed rounds that every shard has a valid copy somewhere:
each holder reads its own copy and the replicas of owners that hold none, then, only if a
shard is still without a verified copy, the remaining replicas of that shard. Verified
bytes stay cached for ``load``, which reads this rank's own copy or, with replication,
receives it through the strategy's retrieve plan and checks it against the sender's
manifest.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ..._logging import get_logger
from ...config import default_timeouts
from ...errors import (
    CheckpointingException,
    CorruptCheckpointError,
)
from .. import _format, _nvrx_format
from .._agreement import agree, agree_gather
from .._format import (
    ShardBuffer,
    crc_of,
    deserialize,
    plan_shard,
    serialize,
)
from .._manifest import CopyInfo
from ..base_state_dict import TensorAwareStateDict
from ..replication import _chunked, _forward
from ..replication.group_utils import CliqueGroup
from . import _catalogue
from ._manager_base import CkptID, ManagerBase

logger = get_logger(__name__)


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


class RestoreSteps(ManagerBase):
    """``find_latest`` and ``load`` of :class:`~.base_manager.BaseCheckpointManager`."""

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
        _, scans = agree_gather(
            "local checkpoint scan",
            lambda: (None, (self._list_copies(set(self._inflight)), self._replication_params())),
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
        """Holders of a verified copy of each shard (by rank), or None if a shard has none.

        Round one verifies the copies of :meth:`_first_round`; a second round, only if some
        shard is still without a verified copy (a corrupt owner copy), verifies the other
        replicas of those shards.
        """
        me, world = self.rank, self.world_size
        first = self._first_round(me, iteration, use_replicas)
        forwarding = self._forwarding(iteration, use_replicas)
        forwarded = forwarding is not None and forwarding.mine is not None
        if use_replicas and not any(c.owner == me for c in first) and not forwarded:
            self._expect_transfer(iteration)
        _, verified = agree_gather(
            "local checkpoint verification", lambda: (None, self._verify_all(first, forwarding))
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
