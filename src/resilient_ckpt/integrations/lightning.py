"""PyTorch Lightning: asynchronous global checkpoints and replicated local checkpoints.

Two pieces, used together (``pip install 'resilient-ckpt[lightning]'``)::

    local = LocalCheckpointCallback("/local_ssd/ckpt", every_n_train_steps=100)
    trainer = L.Trainer(
        strategy="ddp",
        plugins=[ResilientCheckpointIO(local=local)],
        callbacks=[local, ModelCheckpoint("ckpt", every_n_train_steps=1000, save_last=True)],
    )
    trainer.fit(model, ckpt_path="last")

* :class:`ResilientCheckpointIO`, a Lightning ``CheckpointIO`` plugin, writes Lightning's own
  checkpoints (``ModelCheckpoint``, ``trainer.save_checkpoint``) through a persistent
  background worker (:class:`~resilient_ckpt.async_ckpt.torch_ckpt.TorchAsyncCheckpoint`):
  ``save_checkpoint`` returns once the checkpoint is snapshotted, and the file appears
  atomically (temporary name, fsync, rename), so a killed job never leaves a torn
  ``last.ckpt``. Lightning calls it on global rank 0 only, so these saves are finalized
  without cross-rank agreement: at the next save, before a remove of the same file, and at
  teardown (where a failed write raises).
* :class:`LocalCheckpointCallback` saves, every ``every_n_train_steps`` optimizer steps and on
  every rank, the whole Lightning checkpoint (what ``trainer.save_checkpoint`` would write:
  weights, optimizer and loop state, callbacks) as a local checkpoint:
  :class:`~resilient_ckpt.local.LocalCheckpointManager` with a
  :class:`~resilient_ckpt.local.CliqueReplicationStrategy`, scheduled on an
  :class:`~resilient_ckpt.async_ckpt.core.AsyncCallsQueue` and committed across ranks at a
  later batch end.

Resume goes through the plugin because Lightning restores loops, optimizers and callbacks
from the dict that ``CheckpointIO.load_checkpoint`` returns; substituting that dict is the one
way to restore everything along Lightning's own code path. ``load_checkpoint`` runs on every
rank; while fitting, it asks the callback for the newest local checkpoint whose every shard
verifies (a collective: lost or corrupt shards come from replicas) and returns it instead of
the global file when its step is at least the global file's ``global_step`` (on a tie the
local copy wins: it is on node-local storage and was just verified). ``validate``/``test``
with a ``ckpt_path`` always load the file asked for.

Limits, by Lightning's design: ``load_checkpoint`` is called only when ``ckpt_path``
resolves to a file, so with ``ckpt_path="last"`` and no global checkpoint written yet,
local checkpoints are not consulted (have ``ModelCheckpoint`` save early). Collecting the
checkpoint dict uses ``trainer._checkpoint_connector.dump_checkpoint``, the function behind
``trainer.save_checkpoint``, for which Lightning has no public name.

Global saves (rank 0 only) and local saves (every rank, collective commits) use separate
queues, because an ``AsyncCallsQueue`` that agrees across ranks needs every rank to
schedule the same requests.
"""

from __future__ import annotations

import os
from typing import Any

try:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.cloud_io import get_filesystem
    from lightning.pytorch.plugins.io import CheckpointIO, TorchCheckpointIO
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "resilient_ckpt.integrations.lightning needs PyTorch Lightning 2.x (the `lightning` "
        "package): pip install 'resilient-ckpt[lightning]'"
    ) from exc

from .. import _dist
from .._logging import get_logger
from ..async_ckpt.core import AsyncCallsQueue
from ..async_ckpt.torch_ckpt import TorchAsyncCheckpoint
from ..config import Timeouts, default_timeouts
from ..errors import ConfigurationError
from ..local import (
    BasicTensorAwareStateDict,
    CliqueReplicationStrategy,
    LocalCheckpointManager,
)

logger = get_logger(__name__)

__all__ = ["LocalCheckpointCallback", "ResilientCheckpointIO"]


def _positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigurationError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class LocalCheckpointCallback(pl.Callback):
    """Every ``every_n_train_steps`` optimizer steps, a replicated local checkpoint.

    Args:
        root_dir: node-local directory; rank ``r`` writes under ``<root_dir>/<session_id>/<r>``.
        every_n_train_steps: save when ``trainer.global_step`` is a multiple of this.
        replication_factor: copies of each rank's shard (1: no replication).
        replication_jump: distance between the ranks of a clique; default: ranks per node
            (``trainer.num_devices``), so copies land on other nodes.
        session_id: separates jobs sharing ``root_dir``.
        keep_latest: committed local checkpoints kept per rank.
        sync_files: fsync local files (False: faster, not crash-durable).

    All ranks run the callback; saves are collective, as ``LocalCheckpointManager.save`` is.
    """

    def __init__(
        self,
        root_dir: str | os.PathLike[str],
        every_n_train_steps: int = 1,
        *,
        replication_factor: int = 2,
        replication_jump: int | None = None,
        session_id: str = "lightning",
        keep_latest: int = 1,
        sync_files: bool = True,
    ) -> None:
        self.root_dir = os.fspath(root_dir)
        self.every_n_train_steps = _positive_int("every_n_train_steps", every_n_train_steps)
        self.replication_factor = _positive_int("replication_factor", replication_factor)
        self.replication_jump = (
            None
            if replication_jump is None
            else _positive_int("replication_jump", replication_jump)
        )
        self.session_id = session_id
        self.keep_latest = _positive_int("keep_latest", keep_latest)
        self.sync_files = sync_files
        self.manager: LocalCheckpointManager | None = None
        self._queue: AsyncCallsQueue | None = None
        self._fitting = False
        self._last_saved = -1

    # -- Lightning hooks ----------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._fitting = stage == "fit"
        if not self._fitting or self.manager is not None:
            return
        strategy = None
        if self.replication_factor > 1:
            jump = self.replication_jump or trainer.num_devices
            strategy = CliqueReplicationStrategy.from_replication_params(
                replication_jump=jump, replication_factor=self.replication_factor
            )
        self.manager = LocalCheckpointManager(
            self.root_dir,
            session_id=self.session_id,
            repl_strategy=strategy,
            keep_latest=self.keep_latest,
            sync_files=self.sync_files,
        )
        AsyncCallsQueue.warmup_persistent_caller(trainer.global_rank)
        self._queue = AsyncCallsQueue()

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self._queue is None or self.manager is None:
            return
        self._queue.maybe_finalize_async_calls(blocking=False, no_dist=False)
        step = trainer.global_step
        if step <= self._last_saved or step % self.every_n_train_steps:
            return
        # What trainer.save_checkpoint writes; every rank builds it (sharded strategies need
        # all ranks for the optimizer state), every rank saves its own.
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        request = self.manager.save(BasicTensorAwareStateDict(checkpoint), step, is_async=True)
        if request is None:
            raise ConfigurationError("LocalCheckpointManager.save(is_async=True) returned None")
        self._queue.schedule_async_request(request)
        self._last_saved = step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._queue is not None:
            self._queue.maybe_finalize_async_calls(blocking=True, no_dist=False)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # Other ranks may not reach another collective: drop pending saves without one.
        if self._queue is not None:
            self._queue.close(abort=True)
            self._queue = None

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._fitting = False
        if self._queue is not None:
            queue, self._queue = self._queue, None
            queue.close()

    # -- resume (called by ResilientCheckpointIO.load_checkpoint, on every rank) ----------

    def newest_checkpoint(self, at_least: int) -> tuple[int, dict[str, Any]] | None:
        """The newest verified local checkpoint if its step is ``>= at_least``. Collective.

        Returns ``(step, checkpoint dict)``, or None when not fitting, when there is no
        complete local checkpoint, or when it is older than ``at_least``.
        """
        if not self._fitting or self.manager is None:
            return None
        latest = self.manager.find_latest()
        if latest < 0 or latest < at_least:
            return None
        state, _ = self.manager.load()
        if not isinstance(state, BasicTensorAwareStateDict):
            raise ConfigurationError(
                f"local checkpoint {latest} under {self.root_dir!r} was not written by "
                f"LocalCheckpointCallback (found {type(state).__name__})"
            )
        self._last_saved = latest
        return latest, state.state_dict


class ResilientCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO``: async atomic ``torch.save`` files; local-first resume.

    Args:
        local: the :class:`LocalCheckpointCallback` whose checkpoints ``load_checkpoint``
            prefers when they are at least as new as the requested file (None: files only).
        sync_files: fsync each file before it is renamed into place.
        timeouts: deadlines of the background worker (default: from the environment).

    ``resumed_from`` tells, after a resume, where the state came from: a dict with
    ``source`` (``"local"`` or ``"global"``), ``step`` and ``path``.
    """

    def __init__(
        self,
        local: LocalCheckpointCallback | None = None,
        *,
        sync_files: bool = True,
        timeouts: Timeouts | None = None,
    ) -> None:
        if local is not None and not isinstance(local, LocalCheckpointCallback):
            raise ConfigurationError(
                f"local must be a LocalCheckpointCallback or None, got {type(local).__name__}"
            )
        self.local = local
        self.sync_files = sync_files
        self.timeouts = timeouts
        self.resumed_from: dict[str, Any] | None = None
        self._writer: TorchAsyncCheckpoint | None = None
        self._pending: dict[int, str] = {}

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise ConfigurationError(
                "ResilientCheckpointIO.save_checkpoint takes no storage_options "
                f"(got {storage_options!r}); it writes local files with torch.save"
            )
        target = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
        if self._writer is None:
            self._writer = TorchAsyncCheckpoint(timeouts=self.timeouts, sync_files=self.sync_files)
        self._collect(blocking=False)
        self._pending[self._writer.async_save(checkpoint, target)] = target

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        self._collect(blocking=True)
        target = os.fspath(path)
        checkpoint: dict[str, Any] | None = None
        if get_filesystem(target).exists(target):
            kwargs = {} if weights_only is None else {"weights_only": weights_only}
            checkpoint = TorchCheckpointIO().load_checkpoint(target, map_location, **kwargs)
        step = int(checkpoint.get("global_step", -1)) if checkpoint is not None else -1
        if self.local is not None and self.local._fitting:
            # Every rank must take the same branch: agree on the newest global step seen.
            step = _dist.max_int(step, (self.timeouts or default_timeouts()).collective)
            local = self.local.newest_checkpoint(at_least=step)
            if local is not None:
                self.resumed_from = {"source": "local", "step": local[0], "path": target}
                logger.info("resuming from local checkpoint %d (global: step %d)", local[0], step)
                return local[1]
        if checkpoint is None:
            raise FileNotFoundError(f"checkpoint {target!r} does not exist (and no local one)")
        self.resumed_from = {"source": "global", "step": step, "path": target}
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        target = os.fspath(path)
        if target in self._pending.values():
            self._collect(blocking=True)  # never delete under a write still in flight
        fs = get_filesystem(target)
        if fs.exists(target):
            fs.rm(target, recursive=True)

    def wait(self) -> None:
        """Block until every global save so far is on disk (raises if one failed)."""
        self._collect(blocking=True)

    def teardown(self) -> None:
        if self._writer is None:
            return
        writer, self._writer = self._writer, None
        try:
            self._collect(blocking=True, writer=writer)
        finally:
            writer.close()

    def _collect(self, blocking: bool, writer: TorchAsyncCheckpoint | None = None) -> None:
        writer = writer or self._writer
        if writer is None:
            return
        for idx in writer.finalize_async_save(blocking=blocking, no_dist=True):
            self._pending.pop(idx, None)
