"""A 2-rank DDP Lightning job on CPU (gloo) for ``test_lightning.py``; run under torchrun.

Each step's batch is a pure function of ``(global_step, rank)`` (the loader only paces the
loop): Lightning cannot resume a plain DataLoader mid-epoch, and this keeps the comparison
about what the checkpoint restores (weights, momentum, step counters). With two ranks
DDP's gradient all-reduce adds two numbers per element, which is exact whatever the bucket
layout, so an interrupted run can match an uninterrupted one bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from lightning_data import batch_for  # this script's directory is on sys.path

from resilient_ckpt.integrations.lightning import (
    LocalCheckpointCallback,
    ResilientCheckpointIO,
    TieredCheckpointCallback,
)


class Steps(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1000

    def __getitem__(self, index: int) -> int:
        return index


class Net(pl.LightningModule):
    def __init__(self, crash_at: int, step_time: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
        )
        self.crash_at = crash_at
        self.step_time = step_time

    def on_train_batch_start(self, batch: object, batch_idx: int) -> None:
        if self.global_step == self.crash_at:
            os.kill(os.getpid(), signal.SIGKILL)  # a node failure: no cleanup of any kind
        time.sleep(self.step_time)

    def training_step(self, batch: object, batch_idx: int) -> torch.Tensor:
        x, y = batch_for(self.global_step, self.global_rank)
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(Steps(), batch_size=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--crash-at", type=int, default=-1)
    parser.add_argument("--local-every", type=int, default=2)
    parser.add_argument("--global-every", type=int, default=10)
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--tiered", action="store_true", help="TieredCheckpointCallback only")
    parser.add_argument("--durable-every", type=int, default=5)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.tiered:
        _fit_tiered(args)
        return
    local = LocalCheckpointCallback(
        os.path.join(args.workdir, "local"),
        every_n_train_steps=args.local_every,
        replication_factor=2,
        replication_jump=1,
    )
    checkpoint_io = ResilientCheckpointIO(local=local)
    global_dir = os.path.join(args.workdir, "global")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(process_group_backend="gloo"),
        max_steps=args.steps,
        plugins=[checkpoint_io],
        callbacks=[
            local,
            _CommitBeforeCrash(local, args.crash_at),
            ModelCheckpoint(
                dirpath=global_dir, every_n_train_steps=args.global_every, save_last=True
            ),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.workdir,
    )
    model = Net(args.crash_at, args.step_time)
    trainer.fit(model, ckpt_path="last")
    if trainer.global_rank == 0:
        torch.save(model.net.state_dict(), os.path.join(args.workdir, "final.pt"))
        summary = {"resumed_from": checkpoint_io.resumed_from, "global_step": trainer.global_step}
        with open(os.path.join(args.workdir, "summary.json"), "w") as f:
            json.dump(summary, f)


class _CommitBeforeCrash(pl.Callback):
    """At the crash step, before the model kills the rank: finish the saves in flight, so
    the newest local checkpoint is the one the test expects whatever the machine's load
    (the callback itself commits them only at later batch ends)."""

    def __init__(self, local: LocalCheckpointCallback, crash_at: int) -> None:
        self.local, self.crash_at = local, crash_at

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, batch_idx: int
    ) -> None:
        if trainer.global_step == self.crash_at and self.local._queue is not None:
            self.local._queue.maybe_finalize_async_calls(blocking=True, no_dist=False)


def _fit_tiered(args: argparse.Namespace) -> None:
    tiered = TieredCheckpointCallback(
        os.path.join(args.workdir, "memory"),
        os.path.join(args.workdir, "durable"),
        every_n_train_steps=1,
        durable_every=args.durable_every,
        replication_jump=1,  # two ranks on one machine stand for two nodes
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(process_group_backend="gloo"),
        max_steps=args.steps,
        callbacks=[tiered],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.workdir,
    )
    model = Net(args.crash_at, args.step_time)
    trainer.fit(model)
    if trainer.global_rank == 0:
        torch.save(model.net.state_dict(), os.path.join(args.workdir, "final.pt"))
        summary = {
            "resumed_from": tiered.resumed_from,
            "global_step": trainer.global_step,
        }
        with open(os.path.join(args.workdir, "summary.json"), "w") as f:
            json.dump(summary, f)


if __name__ == "__main__":
    main()
