"""PyTorch Lightning, tiered mode: frequent RAM checkpoints with peer copies, some made durable.

One callback, on every rank::

    tiered = TieredCheckpointCallback("/dev/shm/job", "/shared/ckpt", durable_every=100)
    trainer = L.Trainer(strategy="ddp", callbacks=[tiered])
    trainer.fit(model)          # resumes by itself from the newest checkpoint on any tier

Every ``every_n_train_steps`` optimizer steps the callback hands the training state to a
:class:`~resilient_ckpt.tiered.TieredCheckpointManager`: the save returns once the state is
snapshotted, the memory-tier write, its replicas on the peer node and (every
``durable_every``-th save) the durable DCP write run in the background, and are committed at
a later batch end.

What is saved, and why in three parts: the weights and the optimizer state as tensors, keyed
by parameter name (``torch.distributed.checkpoint.state_dict.get_state_dict``, as torchtitan
does), so they are staged without serialisation and restore at another world size; the rest
of Lightning's checkpoint (loop progress, callbacks, schedulers, hyper-parameters: small,
and of no fixed shape) as one pickled value.

Resume happens in ``on_fit_start``, because only there do the model *and* the optimizers
exist (Lightning restores an explicit ``ckpt_path`` before the optimizers are created, which
would leave no place to load optimizer tensors into). The callback loads the newest
verified checkpoint of either tier (memory first when it is at least as new, lost shards
from peers' copies) into the live model and optimizers, then gives Lightning the rest of the
checkpoint so that its own code restores loops, callbacks and schedulers right after this
hook. A ``ckpt_path`` file passed to ``fit`` still wins when its ``global_step`` is newer.
This uses ``trainer._checkpoint_connector`` (``dump_checkpoint`` and the restore steps that
follow ``on_fit_start``), for which Lightning has no public name.

After the resume the callback warms the manager up with the state's layout
(:meth:`TieredCheckpointManager.warmup`): the first save then stalls like a steady one.

At the very first fit, ``get_state_dict`` creates the optimizer's state with a zero-lr step
over zero gradients (torch's own way to give the state a shape to load into). That step is
not harmless: Adam's step counter would start at 1 and its bias corrections differ from a fit
without this callback. So when nothing was restored, the optimizers whose state was empty get
it back empty after the warm-up (the first real step creates it, with the layout the warm-up
planned for).
"""

from __future__ import annotations

import io
import os
from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .._logging import get_logger
from ..errors import ConfigurationError
from ..tiered import TieredCheckpointManager

logger = get_logger(__name__)

__all__ = ["TieredCheckpointCallback"]

# Lightning's checkpoint keys saved as tensors (the rest is pickled as one value).
_TENSOR_KEYS = ("state_dict", "optimizer_states")


def _positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigurationError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _pack(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _unpack(blob: Any) -> dict[str, Any]:
    if not isinstance(blob, (bytes, bytearray)):
        raise ConfigurationError(
            f"tiered checkpoint holds no Lightning trainer state (got {type(blob).__name__}); "
            "was it written by TieredCheckpointCallback?"
        )
    # Lightning's own state (loops, callbacks, hyper-parameters: arbitrary objects), which this
    # job saved to its own tiers: trusted as the manager's default restore is.
    value = torch.load(io.BytesIO(blob), weights_only=False)
    if not isinstance(value, dict):
        raise ConfigurationError("tiered checkpoint: the Lightning trainer state is not a dict")
    return value


class TieredCheckpointCallback(pl.Callback):
    """Tiered checkpoints of a Lightning fit, resumed from the fastest tier that has the newest.

    Args:
        memory_dir: node-local RAM directory (e.g. ``/dev/shm/<job>``); rank subdirectories.
        durable_dir: shared storage or ``msc://profile/prefix`` for the durable DCP copies.
        every_n_train_steps: save when ``trainer.global_step`` is a multiple of this.
        durable_every: every N-th save also goes to ``durable_dir`` (at global steps that
            are multiples of ``every_n_train_steps * durable_every``).
        replication_factor: copies of each rank's shard in the memory tier.
        replication_jump: distance between a shard's copies; default: ranks per node
            (``trainer.num_devices``), so copies land on other nodes.
        keep_memory / keep_durable: committed checkpoints kept per tier.

    ``resumed_from`` tells, after ``fit`` started, what was restored: None (fresh start or
    a ``ckpt_path`` file that was newer) or a dict with ``step`` and what the manager reports
    about the restore (``tier`` and the like, when it reports them).
    """

    def __init__(
        self,
        memory_dir: str | os.PathLike[str],
        durable_dir: str | os.PathLike[str],
        every_n_train_steps: int = 1,
        durable_every: int = 10,
        *,
        replication_factor: int = 2,
        replication_jump: int | None = None,
        keep_memory: int = 2,
        keep_durable: int = 2,
    ) -> None:
        self.memory_dir = os.fspath(memory_dir)
        self.durable_dir = os.fspath(durable_dir)
        self.every_n_train_steps = _positive_int("every_n_train_steps", every_n_train_steps)
        self.durable_every = _positive_int("durable_every", durable_every)
        self.replication_factor = _positive_int("replication_factor", replication_factor)
        self.replication_jump = (
            None
            if replication_jump is None
            else _positive_int("replication_jump", replication_jump)
        )
        self.keep_memory = _positive_int("keep_memory", keep_memory)
        self.keep_durable = _positive_int("keep_durable", keep_durable)
        self.manager: TieredCheckpointManager | None = None
        self.resumed_from: dict[str, Any] | None = None
        self._last_saved = -1

    # -- Lightning hooks ----------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self.manager is not None:
            return
        self.manager = TieredCheckpointManager(
            self.memory_dir,
            self.durable_dir,
            replication_factor=self.replication_factor,
            replication_jump=self.replication_jump or trainer.num_devices,
            durable_every=self.durable_every,
            keep_memory=self.keep_memory,
            keep_durable=self.keep_durable,
        )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.manager is None:
            return
        empty = [_EmptyState(o) for o in trainer.optimizers if not o.state]
        model_sd, optim_sd = get_state_dict(pl_module, trainer.optimizers)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd, "trainer": b""}
        restored = self._resume(self.manager, trainer, pl_module, state)
        # Plan, start the worker and pre-fault its arena now, so the first save stalls like
        # the others (collective, like the load; writes nothing).
        self.manager.warmup(state)
        if not restored:
            for optimizer in empty:  # undo get_state_dict's zero-lr step (module docstring)
                optimizer.restore()

    def _resume(
        self,
        manager: TieredCheckpointManager,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        state: dict[str, Any],
    ) -> bool:
        """Load the newest tiered checkpoint into ``state`` and hand Lightning the rest;
        whether one was restored."""
        connector = trainer._checkpoint_connector
        file_step = int(connector._loaded_checkpoint.get("global_step", -1))
        # Every rank loads, whatever it finds: the load is collective and decides for all.
        step = manager.load(state)
        if step is None or step < file_step:
            return False
        set_state_dict(
            pl_module,
            trainer.optimizers,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        checkpoint = _unpack(state["trainer"])
        checkpoint["state_dict"] = pl_module.state_dict()
        checkpoint["optimizer_states"] = [
            trainer.strategy.optimizer_state(o) for o in trainer.optimizers
        ]
        # Lightning restores loops, optimizers and schedulers from this right after the hook.
        connector._loaded_checkpoint = checkpoint
        connector.restore_datamodule()
        connector.restore_callbacks()
        self._last_saved = step
        self.resumed_from = {"step": step, **_restore_report(manager)}
        logger.info("resumed from tiered checkpoint %d (%s)", step, self.resumed_from)
        return True

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self.manager is None:
            return
        self.manager.maybe_finalize(blocking=False)
        step = trainer.global_step
        if step <= self._last_saved or step % self.every_n_train_steps:
            return
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        model_sd, optim_sd = get_state_dict(pl_module, trainer.optimizers)
        rest = {k: v for k, v in checkpoint.items() if k not in _TENSOR_KEYS}
        state = {"model": model_sd, "optim": optim_sd, "trainer": _pack(rest)}
        # Durable at fixed steps, whatever step a resumed job started from.
        durable = step % (self.every_n_train_steps * self.durable_every) == 0
        self.manager.save(state, step, durable=durable)
        self._last_saved = step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.manager is not None:
            self.manager.maybe_finalize(blocking=True)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._close()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._close()

    def _close(self) -> None:
        if self.manager is not None:
            manager, self.manager = self.manager, None
            manager.close()


class _EmptyState:
    """An optimizer whose state is empty now, and can be made so again: its state cleared,
    and the flag an LR scheduler's step wrapper sets on it put back as it was."""

    _UNSET = object()

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.called = optimizer.__dict__.get("_opt_called", self._UNSET)

    def restore(self) -> None:
        self.optimizer.state.clear()
        if self.called is self._UNSET:
            self.optimizer.__dict__.pop("_opt_called", None)
        else:
            self.optimizer.__dict__["_opt_called"] = self.called


def _restore_report(manager: TieredCheckpointManager) -> dict[str, Any]:
    """What the manager says about its last restore (which tier, ...), as plain values."""
    report = getattr(manager, "last_restore", None)
    if report is None:
        return {}
    items = report.items() if isinstance(report, dict) else vars(report).items()
    return {k: v for k, v in items if isinstance(v, (str, int, float, bool, list, tuple))}
