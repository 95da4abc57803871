"""One training job of the demo, run under ``torchrun`` on CPU (gloo).

A small MLP with DDP and SGD+momentum learns a fixed random regression target. Batches are a
pure function of (step, rank), so a resumed run sees exactly the data an uninterrupted run
would. Every ``--save-every`` steps each rank saves its model and optimizer state through
an :class:`~resilient_ckpt.AsyncCallsQueue` (an atomic ``torch.save`` in the background
worker); once every rank's file is durable (cross-rank finalize), rank 0's finalize function
commits the step by atomically rewriting ``latest``. With
``--crash-at-step`` every rank SIGKILLs itself there, mid-training, possibly mid-save.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..async_ckpt._files import write_atomically
from ..async_ckpt.core import AsyncCallsQueue, AsyncRequest
from ..async_ckpt.torch_ckpt import save_atomically

HIDDEN = 512


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(64, 32, generator=gen)
    return x, x.sum(dim=1, keepdim=True).sin()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, 1),
    )


def _commit(ckpt_dir: str, step: int) -> None:
    def _write(f: object) -> None:
        f.write(json.dumps({"step": step}).encode())  # type: ignore[attr-defined]

    write_atomically(os.path.join(ckpt_dir, "latest"), _write)


def _latest(ckpt_dir: str) -> int:
    try:
        with open(os.path.join(ckpt_dir, "latest")) as f:
            return int(json.load(f)["step"])
    except FileNotFoundError:
        return 0


def run(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # Start the background worker now, so the first save does not wait for its start-up.
    AsyncCallsQueue.warmup_persistent_caller(rank)
    model = DistributedDataParallel(_model())
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start = _latest(args.ckpt_dir)
    if start:
        state = torch.load(os.path.join(args.ckpt_dir, f"step_{start:05d}", f"rank{rank}.pt"))
        model.module.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        if rank == 0:
            print(f"[demo] resumed from committed step {start}", flush=True)
    queue = AsyncCallsQueue()
    stats: list[dict] = []
    for step in range(start + 1, args.steps + 1):
        queue.maybe_finalize_async_calls(blocking=False, no_dist=False)
        x, y = _batch(step, rank)
        optim.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optim.step()
        time.sleep(args.step_time)  # stands in for the rest of a real step's compute
        if step == args.crash_at_step:
            time.sleep(0.05)  # let the last save be in flight
            os.kill(os.getpid(), signal.SIGKILL)
        if step % args.save_every == 0:
            step_dir = os.path.join(args.ckpt_dir, f"step_{step:05d}")
            os.makedirs(step_dir, exist_ok=True)
            state = {"model": model.module.state_dict(), "optim": optim.state_dict()}
            request = AsyncRequest(
                save_atomically, (state, os.path.join(step_dir, f"rank{rank}.pt")), []
            )
            if rank == 0:
                request.add_finalize_fn(functools.partial(_commit, args.ckpt_dir, step))
            stats.append({"idx": queue.schedule_async_request(request), "step": step})
    queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    if rank == 0:
        _report(queue, stats)
        torch.save(model.module.state_dict(), args.final)
    queue.close()
    dist.destroy_process_group()


def _report(queue: AsyncCallsQueue, stats: list[dict]) -> None:
    for s in stats:
        t = queue.timings.get(s["idx"], {})
        print(
            f"[demo] save step {s['step']:3d}: stall {t.get('stall', 0) * 1e3:7.2f} ms  "
            f"write {t.get('write', 0) * 1e3:7.2f} ms (background)  "
            f"finalize {t.get('finalize', 0) * 1e3:6.2f} ms  "
            f"bytes {int(t.get('bytes', 0)):,}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--final", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--crash-at-step", type=int, default=-1)
    parser.add_argument("--step-time", type=float, default=0.02)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
