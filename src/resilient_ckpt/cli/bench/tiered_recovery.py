"""Tiered checkpointing benchmark: recovery after a node loss, and the stall of a durable save.

Runs N ranks (gloo, spawned by ``resilient_ckpt.testing.launch``), two simulated nodes of
N/2 ranks, each rank with a state of ``--size-mib`` MiB, through one
:class:`~resilient_ckpt.tiered.TieredCheckpointManager` (memory tier in ``/dev/shm``,
replication factor 2 across the two nodes, durable tier on disk, ``durable_every=2``), and
prints, as medians of ``--repeats`` (worst rank of each repeat):

* the trainer stall of a save that also goes to the durable tier against a memory-only
  save (target <= 1.1x: both tiers are fed from one snapshot), with a single-thread copy
  of the same bytes into pre-allocated shared memory as the floor;
* restoring the newest step after node 1's memory tier is deleted (each simulated node has
  its own memory directory, as node-local ``/dev/shm`` would be, so node 1's ranks receive
  their shards from node 0's replicas over the process group), and a restart with every
  tier intact, against restoring the same step from the durable tier with a cold page
  cache (every durable file fsynced and dropped with ``posix_fadvise(DONTNEED)``, the
  memory tier hidden): target >= 3x after the node loss; a cold raw read of the same
  durable files is the reference of the durable figure.

Restores are job times (a barrier before, a barrier after) of a fresh manager's ``load``
into a zeroed state (the manager's start-up, the same for both tiers, is not counted),
checked bit-exact against what was saved and against the tier the manager reports.

Run by ``resilient-ckpt bench --only tiered_recovery [-- --ranks 4 --size-mib 64]`` (the
durable tier under ``--dir``) or ``python benchmarks/tiered_recovery.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from resilient_ckpt.testing import launch
from resilient_ckpt.tiered import TieredCheckpointManager

from .common import evict, raw_read

TENSORS = 16
DURABLE_EVERY = 2


def _state(rank: int, nbytes: int) -> dict[str, Any]:
    # Keys name the rank: plain tensors under one key would be deduplicated by DCP's
    # planner (saved by one rank only), and every rank must save its own bytes.
    per = max(1, nbytes // TENSORS // 4)
    gen = torch.Generator().manual_seed(rank)
    layers = {f"rank{rank}.layer{i}": torch.rand(per, generator=gen) for i in range(TENSORS)}
    return {"model": layers}


def _zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}


def _worst(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    dist.barrier()
    start = time.perf_counter()
    result = fn()
    dist.barrier()
    return time.perf_counter() - start, result


def _files(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, names in os.walk(root) for f in names]


def _memcpy_floor(state: dict[str, Any], repeats: int) -> float:
    tensors = list(state["model"].values())
    dst = [torch.empty_like(t).share_memory_() for t in tensors]
    samples = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for d, t in zip(dst, tensors, strict=True):
            d.copy_(t)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[1:])


class _Run:
    def __init__(self, rank: int, world: int, memory: str, durable: str, nbytes: int) -> None:
        self.rank, self.world = rank, world
        self.memory, self.durable = memory, durable
        self.state = _state(rank, nbytes)
        self.node1 = list(range(world // 2, world))

    def node_dir(self) -> str:
        """This rank's node's memory tier: one directory per simulated node, as node-local
        ``/dev/shm`` would be, so a lost node's shards must come over the process group."""
        return os.path.join(self.memory, "node1" if self.rank in self.node1 else "node0")

    def manager(self) -> TieredCheckpointManager:
        return TieredCheckpointManager(
            self.node_dir(),
            self.durable,
            replication_factor=2,
            replication_jump=max(1, self.world // 2),
            durable_every=DURABLE_EVERY,
            keep_memory=2,
            keep_durable=1,
        )

    def stalls(self, repeats: int) -> tuple[list[float], list[float], int]:
        """Alternate memory-only and memory+durable saves; the worst rank's stall of each."""
        mgr = self.manager()
        memory_only: list[float] = []
        durable: list[float] = []
        step = 0
        for _ in range(repeats + 1):  # the first pair warms up the worker and the arenas
            for _ in range(DURABLE_EVERY):
                step += 1
                dist.barrier()
                start = time.perf_counter()
                mgr.save(self.state, step, durable=step % DURABLE_EVERY == 0)
                stall = _worst(time.perf_counter() - start)
                mgr.maybe_finalize(blocking=True)
                (durable if step % DURABLE_EVERY == 0 else memory_only).append(stall)
        mgr.close()
        return memory_only[1:], durable[1:], step

    def restore(self, step: int, tier: str) -> float:
        """Job time of a fresh manager's ``load`` (its start-up, the same for both tiers,
        is not counted), checked bit-exact."""
        mgr = self.manager()
        into = _zeros_like(self.state)
        seconds, got = _timed(lambda: mgr.load(into))
        used = (getattr(mgr, "last_restore", None) or {}).get("tier")
        mgr.close()
        if (got, used) != (step, tier):
            raise RuntimeError(
                f"rank {self.rank}: restored step {got} from {used}, expected {step} from {tier}"
            )
        for key, tensor in self.state["model"].items():
            if not torch.equal(into["model"][key], tensor):
                raise RuntimeError(f"rank {self.rank}: {key} differs after the restore")
        return seconds

    def after_node_loss(self, step: int) -> float:
        """Node 1's memory tier is gone (a replaced node): its ranks receive their shards
        from node 0's copies over the process group."""
        lost = self.rank == self.node1[0]
        node1 = os.path.join(self.memory, "node1")
        aside = f"{self.memory}.aside"
        if lost:
            shutil.move(node1, aside)
        dist.barrier()
        seconds = self.restore(step, "memory")
        dist.barrier()
        if lost:
            shutil.rmtree(node1, ignore_errors=True)  # whatever the restore re-created
            shutil.move(aside, node1)
        dist.barrier()  # node 1's tier is back before anyone moves the tiers
        return seconds

    def from_durable_cold(self, step: int) -> tuple[float, float, int]:
        aside = f"{self.memory}.hidden"
        if self.rank == 0:
            os.rename(self.memory, aside)
            os.makedirs(self.memory)
            evict(_files(self.durable))
        dist.barrier()  # no rank's manager may see the memory tier
        seconds = self.restore(step, "durable")
        if self.rank == 0:
            evict(_files(self.durable))
        mine = _files(self.durable)[self.rank :: self.world]
        raw, _ = _timed(lambda: raw_read(mine))
        nbytes = sum(os.path.getsize(path) for path in mine)
        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(self.memory)
            os.rename(aside, self.memory)
        dist.barrier()
        return seconds, raw, int(_worst(float(nbytes)))


def _run(rank: int, world: int, memory: str, durable: str, nbytes: int, repeats: int) -> Any:
    run = _Run(rank, world, memory, durable, nbytes)
    floor = _worst(_memcpy_floor(run.state, repeats))
    memory_only, durable_stalls, step = run.stalls(repeats)
    restart = [run.restore(step, "memory") for _ in range(repeats)]
    node_loss = [run.after_node_loss(step) for _ in range(repeats)]
    cold = [run.from_durable_cold(step) for _ in range(repeats)]
    return {
        "memcpy": floor,
        "stall_memory": statistics.median(memory_only),
        "stall_durable": statistics.median(durable_stalls),
        "restore_restart": statistics.median(restart),
        "restore_memory": statistics.median(node_loss),
        "restore_durable": statistics.median(c[0] for c in cold),
        "raw_read_durable": statistics.median(c[1] for c in cold),
        "step": step,
    }


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tiered_recovery", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--ranks", type=int, default=4, help="even: two simulated nodes")
    parser.add_argument("--size-mib", type=int, default=64, help="state per rank")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory-root", default="/dev/shm", help="parent of the memory tier")
    parser.add_argument(
        "--durable-root", "--dir", default=None, help="parent of the durable tier (your storage)"
    )
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.ranks < 2 or args.ranks % 2:
        parser.error(f"--ranks must be even and >= 2 (two simulated nodes), got {args.ranks}")
    if args.size_mib < 1 or args.repeats < 1:
        parser.error("--size-mib and --repeats must be >= 1")
    return args


def _print(args: argparse.Namespace, r: dict[str, Any]) -> None:
    ms = 1e3
    rows = [
        ("memcpy into shared memory (floor)", r["memcpy"] * ms, "", ""),
        ("save stall, memory tier only", r["stall_memory"] * ms, "", ""),
        (
            "save stall, memory + durable",
            r["stall_durable"] * ms,
            f"{r['stall_durable'] / r['stall_memory']:.2f}x memory-only",
            "<= 1.1x",
        ),
        (
            "restart, memory tier intact",
            r["restore_restart"] * ms,
            f"durable cold = {r['restore_durable'] / r['restore_restart']:.2f}x this",
            "",
        ),
        (
            "restore after node loss (memory tier)",
            r["restore_memory"] * ms,
            f"durable cold = {r['restore_durable'] / r['restore_memory']:.2f}x this",
            ">= 3x",
        ),
        (
            "restore same step, durable, cold cache",
            r["restore_durable"] * ms,
            "",
            "",
        ),
        (
            "raw cold read of the durable files",
            r["raw_read_durable"] * ms,
            f"durable restore = {r['restore_durable'] / r['raw_read_durable']:.2f}x this",
            "",
        ),
    ]
    print(
        f"\ntiered recovery: {args.ranks} ranks (2 simulated nodes), {args.size_mib} MiB per "
        f"rank, step {r['step']}, medians of {args.repeats} (worst rank), torch "
        f"{torch.__version__}, {os.cpu_count()} CPUs"
    )
    print(f"{'figure':<40} {'ms':>9}  {'ratio':<34} target")
    for name, value, ratio, target in rows:
        print(f"{name:<40} {value:9.2f}  {ratio:<34} {target}")
    print(
        f"\nrecovery from the memory tier vs durable (cold): "
        f"{r['restore_durable'] / r['restore_memory']:.1f}x after a node loss (shards over "
        f"the process group), {r['restore_durable'] / r['restore_restart']:.1f}x on a "
        "restart with every node's tier intact"
    )


def _write_json(path: str, args: argparse.Namespace, r: dict[str, Any]) -> None:
    case = f"{args.ranks} ranks x {args.size_mib} MiB"
    figures = [
        ("stall", "save, memory + durable", r["stall_durable"], "memory-only save", "<= 1.1x"),
        ("stall", "save, memory only", r["stall_memory"], "memcpy floor", ""),
        (
            "recovery",
            "restore from memory, node lost",
            r["restore_memory"],
            "durable, cold",
            ">= 3x",
        ),
        ("recovery", "restore from memory, restart", r["restore_restart"], "durable, cold", ""),
    ]
    refs = {
        "memory-only save": r["stall_memory"],
        "memcpy floor": r["memcpy"],
        "durable, cold": r["restore_durable"],
    }
    document = {
        "benchmark": "tiered_recovery",
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "ranks": args.ranks,
        "size_mib": args.size_mib,
        "raw": r,
        "figures": [
            {
                "metric": metric,
                "unit": "s",
                "case": case,
                "label": label,
                "value": value,
                "reference": ref,
                "reference_value": refs[ref],
                "target": target,
            }
            for metric, label, value, ref, target in figures
        ],
    }
    with open(path, "w") as f:
        json.dump(document, f, indent=2)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    memory = tempfile.mkdtemp(prefix="rc_tiered_bench_", dir=args.memory_root)
    durable_parent = tempfile.mkdtemp(prefix="rc_tiered_bench_", dir=args.durable_root)
    durable = os.path.join(durable_parent, "durable")
    try:
        results = launch(
            _run,
            args.ranks,
            memory,
            durable,
            args.size_mib << 20,
            args.repeats,
            timeout=600,
            start_method="spawn",
            env={"OMP_NUM_THREADS": "1"},
        )
    finally:
        for path in (memory, f"{memory}.aside", f"{memory}.hidden"):  # also after a failure
            shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(durable_parent, ignore_errors=True)
    _print(args, results[0])
    if args.json:
        _write_json(args.json, args, results[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
