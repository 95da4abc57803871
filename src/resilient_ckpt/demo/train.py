"""One training job of the demo, run under ``torchrun`` on CPU (gloo).

A small MLP, data-parallel with SGD+momentum, learns a fixed regression target; batches are a pure
function of (step, rank), so a resumed run sees exactly the data an uninterrupted run would.
Two kinds of checkpoint share one :class:`~resilient_ckpt.AsyncCallsQueue`:

* every ``--dcp-every`` steps an async ``torch.distributed.checkpoint`` save
  (:class:`FileSystemWriterAsync`, plan caching on) to ``<ckpt>/dcp/iter_<step>``, committed
  by its ``.metadata``;
* every ``--local-every`` steps a local per-rank save (:class:`LocalCheckpointManager`) with
  replication factor 2, so losing one rank's files of each clique loses nothing.

At start the job resumes from the newer of the two. With ``--crash-at-step`` every rank
SIGKILLs itself there, mid-training, with saves possibly in flight. Rank 0 writes a JSON
summary of its saves (stall per save, bytes) and of the resume (recovery time).
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
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..async_ckpt.core import AsyncCallsQueue, AsyncRequest
from ..async_ckpt.filesystem_async import FileSystemWriterAsync
from ..async_ckpt.state_dict_saver import (
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from ..local import BasicTensorAwareStateDict, CliqueReplicationStrategy, LocalCheckpointManager
from ..storage.commit import COMMIT_RECORD

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


def _average_gradients(model: torch.nn.Module) -> None:
    """Data parallelism with a fixed reduction order.

    DDP re-buckets gradients after its first iteration, so a resumed run would sum them in
    another order than an uninterrupted one did and differ in the last bits. One all-reduce
    per parameter, always in the same order, keeps resumed runs bit-exact.
    """
    world = dist.get_world_size()
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            param.grad.div_(world)


def _state(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    # FQN-keyed optimizer state (DCP needs string keys; optimizer.state_dict() uses ints).
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd, "step": step}


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def _memcpy_floor(state: dict[str, Any]) -> float:
    """Median time to copy the state's bytes into pre-allocated shared memory."""
    tensors = [t for t in _flat(state) if t.numel()]
    dst = [torch.empty_like(t).share_memory_() for t in tensors]
    samples = []
    for _ in range(7):
        start = time.perf_counter()
        for d, t in zip(dst, tensors, strict=True):
            d.copy_(t)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[1:])


def _flat(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _flat(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _flat(v)]
    return []


def _latest_dcp(dcp_root: str) -> int:
    steps = [
        int(n.split("_")[1])
        for n in os.listdir(dcp_root)
        if n.startswith("iter_") and os.path.exists(os.path.join(dcp_root, n, COMMIT_RECORD))
    ]
    return max(steps, default=-1)


def _resume(
    args: argparse.Namespace,
    manager: LocalCheckpointManager,
    model: torch.nn.Module,
    optim: torch.optim.Optimizer,
) -> tuple[int, dict[str, Any]]:
    started = time.perf_counter()
    local_step = manager.find_latest()
    dcp_step = _latest_dcp(os.path.join(args.ckpt_dir, "dcp"))
    info: dict[str, Any] = {"local_latest": local_step, "dcp_latest": dcp_step}
    if local_step == -1 and dcp_step == -1:
        return 0, info
    if local_step >= dcp_step:
        tensor_state, _ = manager.load()
        if not isinstance(tensor_state, BasicTensorAwareStateDict):
            raise TypeError(f"unexpected local checkpoint type {type(tensor_state).__name__}")
        state = tensor_state.state_dict
        info["source"] = "local"
    else:
        state = _state(model, optim, 0)
        dcp.load(state, checkpoint_id=os.path.join(args.ckpt_dir, "dcp", f"iter_{dcp_step:07d}"))
        info["source"] = "dcp"
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    info["recovery_s"] = time.perf_counter() - started
    return int(state["step"]), info


def _save_dcp(args: argparse.Namespace, queue: AsyncCallsQueue, state: dict, step: int) -> int:
    writer = FileSystemWriterAsync(
        os.path.join(args.ckpt_dir, "dcp", f"iter_{step:07d}"), thread_count=2
    )
    plan = save_state_dict_async_plan(state, writer, enable_cache=True)
    save_fn, preload_fn, save_args = writer.get_save_function_and_args()
    finalize = [lambda: save_state_dict_async_finalize(*plan)]
    return queue.schedule_async_request(
        AsyncRequest(save_fn, save_args, finalize, preload_fn=preload_fn)
    )


def run(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    AsyncCallsQueue.warmup_persistent_caller(rank)
    os.makedirs(os.path.join(args.ckpt_dir, "dcp"), exist_ok=True)
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    repl = CliqueReplicationStrategy.from_replication_params(
        replication_jump=1, replication_factor=2
    )
    manager = LocalCheckpointManager(
        os.path.join(args.ckpt_dir, "local"), session_id="demo", repl_strategy=repl
    )
    start, resume = _resume(args, manager, model, optim)
    if rank == 0 and start:
        print(
            f"[demo] resumed at step {start} from the {resume['source']} checkpoint "
            f"(local latest {resume['local_latest']}, DCP latest {resume['dcp_latest']}) in "
            f"{resume['recovery_s']:.2f}s",
            flush=True,
        )
    queue = AsyncCallsQueue()
    saves: list[dict[str, Any]] = []
    floor = None
    for step in range(start + 1, args.steps + 1):
        queue.maybe_finalize_async_calls(blocking=False, no_dist=False)
        x, y = _batch(step, rank)
        optim.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        _average_gradients(model)
        optim.step()
        time.sleep(args.step_time)  # stands in for the rest of a real step's compute
        if step == args.crash_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        state = _state(model, optim, step)
        floor = floor if floor is not None else _memcpy_floor(state)
        for kind, every in (("dcp", args.dcp_every), ("local", args.local_every)):
            if step % every:
                continue
            started = time.perf_counter()
            if kind == "dcp":
                idx = _save_dcp(args, queue, state, step)
            else:
                request = manager.save(BasicTensorAwareStateDict(state), step, is_async=True)
                if request is None:
                    raise RuntimeError("LocalCheckpointManager.save(is_async=True) gave no request")
                idx = queue.schedule_async_request(request)
            saves.append(
                {
                    "kind": kind,
                    "step": step,
                    "idx": idx,
                    "bytes": _nbytes(state),
                    "stall_s": time.perf_counter() - started,
                }
            )
    queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    for save in saves:
        timings = queue.timings.get(save["idx"], {})
        save["write_s"] = timings.get("write", 0.0)
        save["finalize_s"] = timings.get("finalize", 0.0)
    queue.close()
    if rank == 0:
        torch.save(model.state_dict(), args.final)
        with open(args.summary, "w") as f:
            json.dump({"saves": saves, "memcpy_floor_s": floor, "resume": resume}, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--final", required=True)
    parser.add_argument("--summary", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--dcp-every", type=int, default=10)
    parser.add_argument("--local-every", type=int, default=2)
    parser.add_argument("--crash-at-step", type=int, default=-1)
    parser.add_argument("--step-time", type=float, default=0.02)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
