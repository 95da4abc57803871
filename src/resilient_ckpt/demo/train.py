"""One training job of the demo, run under ``torchrun`` on CPU (gloo).

A small MLP learns a fixed regression target with SGD+momentum. The checkpointed state is
sharded the way FSDP shards it: every parameter and momentum buffer is saved as a
``DTensor`` with ``Shard(0)`` over all ranks, so each rank owns a different slice, a lost
rank's slice exists only in its peers' replicas, and a job at another world size needs
slices cut differently (elastic restore). The arithmetic itself runs on full replicas.

Bit-exact at any world size: every step consumes the same ``MICRO`` micro-batches (a pure
function of the step and the micro-batch index), spread over the ranks; each micro-batch's
gradient is computed alone, all of them are gathered, and every rank sums them in
micro-batch order. So 4 ranks and 2 ranks compute the same bits, and a run resumed from a
checkpoint (at either size) ends with the weights of an uninterrupted one.

Checkpoints: a :class:`~resilient_ckpt.tiered.TieredCheckpointManager` saves every step to
the memory tier (replicated to the peer on the other simulated node) and every
``--durable-every`` steps also to the durable tier. With ``--crash-at-step`` every rank
SIGKILLs itself right after that step's save returned, with its writes still in flight.
Rank 0 writes a JSON summary (the stall of every save, the memcpy floor, the resume) and
appends each save's stall to ``--saves-log`` as it goes, so killed runs report theirs too.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .._torch_compat import DTensor, Shard, distribute_tensor
from ..tiered import TieredCheckpointManager

HIDDEN = 512
MICRO = 4  # micro-batches per step; the world size must divide it


def _batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(32, 32, generator=gen)
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


def _train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    """One step over all ``MICRO`` micro-batches, summed in a fixed order (see module doc)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    params = list(model.parameters())
    mine = []
    for micro in range(rank * MICRO // world, (rank + 1) * MICRO // world):
        model.zero_grad(set_to_none=True)
        x, y = _batch(step, micro)
        torch.nn.functional.mse_loss(model(x), y).backward()
        mine.append(torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None]))
    local = torch.stack(mine)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    grads = [g for block in gathered for g in block]  # micro-batch order
    total = grads[0].clone()
    for g in grads[1:]:
        total += g
    total /= MICRO
    offset = 0
    for p in params:
        p.grad = total[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    optim.step()


def _shard(tensor: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    # src_data_rank=None: every rank holds the full tensor and keeps its own slice, no comms.
    return distribute_tensor(tensor.detach(), mesh, [Shard(0)], src_data_rank=None)


def _state(
    model: torch.nn.Module, optim: torch.optim.Optimizer, mesh: DeviceMesh, step: int
) -> dict[str, Any]:
    named = dict(model.named_parameters())
    momentum = {
        name: optim.state[p]["momentum_buffer"]
        for name, p in named.items()
        if "momentum_buffer" in optim.state.get(p, {})
    }
    return {
        "model": {name: _shard(p, mesh) for name, p in named.items()},
        "optim": {name: _shard(m, mesh) for name, m in momentum.items()},
        "step": step,
    }


def _template(model: torch.nn.Module, mesh: DeviceMesh) -> dict[str, Any]:
    """The state to load into: this world size's slices, and momentum for every parameter
    (a checkpoint is only ever taken after an optimizer step)."""
    named = dict(model.named_parameters())
    return {
        "model": {name: _shard(torch.zeros_like(p), mesh) for name, p in named.items()},
        "optim": {name: _shard(torch.zeros_like(p), mesh) for name, p in named.items()},
        "step": -1,
    }


def _resume(
    manager: TieredCheckpointManager,
    model: torch.nn.Module,
    optim: torch.optim.Optimizer,
    mesh: DeviceMesh,
) -> tuple[int, dict[str, Any]]:
    started = time.perf_counter()
    state = _template(model, mesh)
    step = manager.load(state)
    loaded_s = time.perf_counter() - started
    if step is None:
        return 0, {}
    if state["step"] != step:
        raise RuntimeError(f"checkpoint of step {step} holds step {state['step']}")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(state["model"][name].full_tensor())
            optim.state[p]["momentum_buffer"] = state["optim"][name].full_tensor().clone()
    recovery_s = time.perf_counter() - started
    report = getattr(manager, "last_restore", None) or {}
    files = report.get("files", {})
    own = os.path.join(manager.memory_dir, str(dist.get_rank())) + os.sep
    # Data files this restore read from another rank's directory (a replica or, after a
    # world size change, a shard another rank wrote), summed over the ranks.
    foreign = torch.tensor([sum(not str(p).startswith(own) for p in files.values())])
    dist.all_reduce(foreign)
    return step, {
        "step": step,
        "tier": report.get("tier", "?"),
        "load_s": loaded_s,
        "recovery_s": recovery_s,
        "world_size": dist.get_world_size(),
        "files_read": len(files),
        "files_from_other_ranks_dirs": int(foreign.item()),
    }


def _memcpy_floor(state: dict[str, Any]) -> tuple[float, int]:
    """Median time to copy this rank's shards into pre-allocated shared memory, and bytes."""
    tensors = [t.to_local() for part in ("model", "optim") for t in state[part].values()]
    dst = [torch.empty_like(t).share_memory_() for t in tensors]
    samples = []
    for _ in range(7):
        start = time.perf_counter()
        for d, t in zip(dst, tensors, strict=True):
            d.copy_(t)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[1:]), sum(t.numel() * t.element_size() for t in tensors)


def _write_summary(path: str, summary: dict[str, Any]) -> None:
    # Written after the resume too: a killed run leaves at least how it resumed.
    with open(path + ".tmp", "w") as f:
        json.dump(summary, f)
    os.replace(path + ".tmp", path)


def run(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if MICRO % world:
        raise SystemExit(f"the world size must divide {MICRO}, got {world}")
    mesh = init_device_mesh("cpu", (world,))
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    manager = None
    start = 0
    resume: dict[str, Any] = {}
    if not args.no_save:
        # Two simulated nodes of world/2 ranks each: a rank's copy lives on the other node.
        manager = TieredCheckpointManager(
            args.memory_dir,
            args.durable_dir,
            replication_factor=2,
            replication_jump=max(1, world // 2),
            durable_every=args.durable_every,
        )
        start, resume = _resume(manager, model, optim, mesh)
        # The saves' structure (momentum for every parameter), so the first save is warm.
        manager.warmup(_template(model, mesh))
    if rank == 0:
        _write_summary(args.summary, {"resume": resume, "world_size": world})
    if rank == 0 and start:
        print(
            f"[demo]     resumed at step {start} on {world} ranks in "
            f"{resume['recovery_s']:.2f}s from the {resume['tier']} tier",
            flush=True,
        )
    saves: list[dict[str, Any]] = []
    floor: tuple[float, int] | None = None
    for step in range(start + 1, args.steps + 1):
        if manager is not None:
            manager.maybe_finalize(blocking=False)
        _train_step(model, optim, step)
        time.sleep(args.step_time)  # stands in for the rest of a real step's compute
        if manager is None:
            continue
        state = _state(model, optim, mesh, step)
        floor = floor or _memcpy_floor(state)
        started = time.perf_counter()
        # Durable at step multiples (the manager's own count restarts with every job).
        durable = step % args.durable_every == 0
        manager.save(state, step, durable=durable)
        stall = time.perf_counter() - started
        saves.append({"step": step, "durable": durable, "stall_s": stall, "world_size": world})
        if rank == 0 and args.saves_log:
            with open(args.saves_log, "a") as f:  # line by line: a killed run keeps its own
                f.write(json.dumps({**saves[-1], "first": len(saves) == 1}) + "\n")
        if step == args.crash_at_step:
            os.kill(os.getpid(), signal.SIGKILL)  # writes of this save are still in flight
    if manager is not None:
        manager.maybe_finalize(blocking=True)
        manager.close()
    if rank == 0:
        torch.save(model.state_dict(), args.final)
        summary = {"saves": saves, "resume": resume, "world_size": world}
        if floor is not None:
            summary.update(memcpy_floor_s=floor[0], shard_bytes=floor[1])
        _write_summary(args.summary, summary)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--memory-dir", default="")
    parser.add_argument("--durable-dir", default="")
    parser.add_argument("--final", required=True)
    parser.add_argument("--summary", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--durable-every", type=int, default=10)
    parser.add_argument("--crash-at-step", type=int, default=-1)
    parser.add_argument("--step-time", type=float, default=0.02)
    parser.add_argument("--no-save", action="store_true", help="the uninterrupted reference")
    parser.add_argument("--saves-log", default="", help="rank 0 appends each save's stall")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
