"""Local checkpoint benchmark: save/load throughput, replication and recovery cost.

Runs N ranks (gloo, spawned by ``resilient_ckpt.testing.launch``) on this machine, each
with a state of ``--size-mib`` MiB, and prints every figure next to its reference measured
in the same run (medians of ``--repeats``):

* save (synchronous, fsync) against ``dd if=/dev/zero bs=8M conv=fsync`` of the same bytes
  on every rank at once;
* save with replication factor 2 against save without replication (target <= 1.3);
* trainer stall of an async save (persistent queue), with and without replication;
* ``find_latest() + load()`` with a cold page cache against ``dd`` reading the same files
  cold (target >= 0.8);
* load after deleting the directory of one member of every clique against a normal load
  of the same replicated checkpoint (target <= 1.5).

Times are job times: from a barrier before the operation to a barrier after it, after the
previous operation's background deletions finished and dirty pages were synced. The page
cache is dropped (``/proc/sys/vm/drop_caches``, needs root) before every cold read; where
that is not permitted the read figures are warm and the table says so.

Usage: ``python benchmarks/local_ckpt.py [--ranks 4] [--size-mib 256] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Figures
from resilient_ckpt.async_ckpt.core import AsyncCallsQueue
from resilient_ckpt.local import (
    BasicTensorAwareStateDict,
    CliqueReplicationStrategy,
    LocalCheckpointManager,
    _deleter,
)
from resilient_ckpt.testing import launch

TENSORS = 16


def make_state(rank: int, nbytes: int) -> dict[str, Any]:
    per = nbytes // TENSORS // 4
    g = torch.Generator().manual_seed(rank)
    layers = {f"layer{i}": torch.rand(per, generator=g) for i in range(TENSORS)}
    return {"model": layers, "step": 0, "rank": rank}


def drop_caches() -> bool:
    """Drop the page cache (rank 0 only, after everyone synced); True if it worked."""
    ok = torch.tensor([0])
    if dist.get_rank() == 0:
        os.sync()
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            ok[0] = 1
        except OSError:
            ok[0] = 0
    dist.broadcast(ok, 0)
    return bool(ok.item())


def settle() -> None:
    """Let the previous operation's background deletions and dirty pages finish first."""
    _deleter.wait_idle()
    os.sync()


def timed(fn: Callable[[], Any]) -> float:
    settle()
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def dd(args: list[str]) -> None:
    subprocess.run(["dd", *args], check=True, capture_output=True)


class Bench:
    def __init__(self, rank: int, root: str, nbytes: int, repeats: int) -> None:
        self.rank, self.root, self.nbytes, self.repeats = rank, root, nbytes, repeats
        self.state = make_state(rank, nbytes)
        self.iteration = 0
        self.cold = True
        self.times: dict[str, float] = {}

    def median(self, name: str, fn: Callable[[], Any], cold: bool = False) -> None:
        samples = []
        for _ in range(self.repeats):
            if cold:
                self.cold = drop_caches() and self.cold
            samples.append(timed(fn))
        self.times[name] = statistics.median(samples)

    def next_iteration(self) -> int:
        self.iteration += 1
        return self.iteration

    def raw(self) -> None:
        path = os.path.join(self.root, f"dd-{self.rank}.bin")
        count = self.nbytes // (8 << 20)

        def _write() -> None:
            dd(["if=/dev/zero", f"of={path}", "bs=8M", f"count={count}", "conv=fsync"])

        samples = []
        for _ in range(self.repeats):
            if os.path.exists(path):  # freeing blocks is not part of the reference write
                os.unlink(path)
            os.sync()
            samples.append(timed(_write))
        self.times["raw write"] = statistics.median(samples)
        self.median("raw read", lambda: dd([f"if={path}", "of=/dev/null", "bs=8M"]), cold=True)
        os.unlink(path)

    def save(self, name: str, mgr: LocalCheckpointManager) -> None:
        def _save() -> None:
            mgr.save(BasicTensorAwareStateDict(self.state), self.next_iteration())

        _save()  # warm-up: directories, process groups
        self.median(name, _save)

    def stall(self, name: str, mgr: LocalCheckpointManager, queue: AsyncCallsQueue) -> None:
        samples = []
        for _ in range(self.repeats + 1):
            settle()
            dist.barrier()
            start = time.perf_counter()
            request = mgr.save(BasicTensorAwareStateDict(self.state), self.next_iteration(), True)
            queue.schedule_async_request(request)
            samples.append(time.perf_counter() - start)
            queue.maybe_finalize_async_calls(blocking=True)
        worst = torch.tensor(samples[1:])  # the first one starts the worker
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        self.times[name] = statistics.median(worst.tolist())

    def load(self, name: str, root: str, make_strategy: Callable[[], Any], lose: list[int]):
        def _load() -> None:
            mgr = LocalCheckpointManager(root, "bench", make_strategy())
            if mgr.find_latest() == -1:
                raise RuntimeError("no checkpoint found")
            mgr.load()

        samples = []
        for _ in range(self.repeats):
            backup = os.path.join(self.root, f"backup-{self.rank}")
            mine = os.path.join(root, "bench", str(self.rank))
            if self.rank in lose:
                shutil.copytree(mine, backup)
                shutil.rmtree(mine)
            self.cold = drop_caches() and self.cold
            samples.append(timed(_load))
            if self.rank in lose:
                shutil.rmtree(mine, ignore_errors=True)
                shutil.move(backup, mine)
        self.times[name] = statistics.median(samples)


def _run(rank: int, world_size: int, root: str, nbytes: int, repeats: int) -> dict[str, Any]:
    bench = Bench(rank, root, nbytes, repeats)
    bench.raw()
    plain_root, repl_root = os.path.join(root, "plain"), os.path.join(root, "repl")
    clique = CliqueReplicationStrategy.from_replication_params(1, 2)
    plain = LocalCheckpointManager(plain_root, "bench")
    repl = LocalCheckpointManager(repl_root, "bench", clique)
    bench.save("save", plain)
    bench.save("save F=2", repl)
    queue = AsyncCallsQueue(persistent=True)
    bench.stall("stall", plain, queue)
    bench.stall("stall F=2", repl, queue)
    queue.close()
    bench.load("load", plain_root, lambda: None, [])
    bench.load("load F=2", repl_root, lambda: clique, [])
    bench.load("load F=2, 1 lost/clique", repl_root, lambda: clique, list(range(1, world_size, 2)))
    return {"times": bench.times, "cold": bench.cold}


def _row(
    name: str, seconds: float, gbps: float | None, ref: str = "", ratio: str = "", target: str = ""
) -> str:
    rate = f"{gbps:7.2f}" if gbps is not None else " " * 7
    return f"{name:<34} {seconds:8.3f} {rate}  {ref:<26} {ratio:>6}  {target}"


def report(times: dict[str, float], ranks: int, nbytes: int, repeats: int, cold: bool) -> None:
    total = ranks * nbytes / 1e9
    t = times
    head = f"{'figure':<34} {'seconds':>8} {'GB/s':>7}  {'reference':<26} {'ratio':>6}  target"
    print(f"\nLocal checkpoint, {ranks} ranks x {nbytes >> 20} MiB, median of {repeats}")
    print("\nSave (synchronous, fsync)\n" + head)
    print(_row("raw write (dd bs=8M conv=fsync)", t["raw write"], total / t["raw write"]))
    print(
        _row(
            "save, no replication",
            t["save"],
            total / t["save"],
            "raw write",
            f"{t['raw write'] / t['save']:.2f}",
            ">= 0.9 (throughput)",
        )
    )
    print(
        _row(
            "save, replication F=2 J=1",
            t["save F=2"],
            total / t["save F=2"],
            "save, no replication",
            f"{t['save F=2'] / t['save']:.2f}",
            "<= 1.3 (time)",
        )
    )
    print(_row("async stall, no replication", t["stall"], None))
    print(
        _row(
            "async stall, replication F=2",
            t["stall F=2"],
            None,
            "async stall, no repl",
            f"{t['stall F=2'] / t['stall']:.2f}",
        )
    )
    temp = "cold cache" if cold else "WARM cache (drop_caches not permitted)"
    print(f"\nLoad ({temp}; find_latest + load, checksums verified)\n" + head)
    print(_row("raw read (dd bs=8M)", t["raw read"], total / t["raw read"]))
    print(
        _row(
            "load, no replication",
            t["load"],
            total / t["load"],
            "raw read",
            f"{t['raw read'] / t['load']:.2f}",
            ">= 0.8 (throughput)",
        )
    )
    print(_row("load, replication F=2", t["load F=2"], total / t["load F=2"]))
    lost = t["load F=2, 1 lost/clique"]
    print(
        _row(
            "load, 1 member/clique deleted",
            lost,
            total / lost,
            "load, replication F=2",
            f"{lost / t['load F=2']:.2f}",
            "<= 1.5 (time)",
        )
    )


def record(times: dict[str, float], ranks: int, nbytes: int, cold: bool) -> Figures:
    """The figures of the printed tables, in GB/s over all ranks' bytes."""
    figures, total = Figures("local_ckpt"), ranks * nbytes / 1e9
    case = f"{ranks} ranks x {nbytes >> 20} MiB"
    read = "dd read" + ("" if cold else " (warm cache)")
    for name, ref, target in (
        ("save", "raw write", ">= 0.9x"),
        ("save F=2", "raw write", ""),
        ("load", "raw read", ">= 0.8x"),
        ("load F=2, 1 lost/clique", "raw read", ""),
    ):
        ref_label = "dd conv=fsync" if ref == "raw write" else read
        figures.add(
            "throughput",
            case,
            f"local {name}",
            total / times[name],
            ref_label,
            total / times[ref],
            target,
        )
    figures.add(
        "stall", case, "local async save, F=2", times["stall F=2"], "no replication", times["stall"]
    )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--size-mib", type=int, default=256, help="state bytes per rank")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--root", default=None, help="directory on the disk to measure")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    if args.ranks % 2:
        parser.error("--ranks must be even (replication factor 2)")
    root = tempfile.mkdtemp(prefix="rc_local_bench_", dir=args.root)
    nbytes = args.size_mib << 20
    try:
        results = launch(_run, args.ranks, root, nbytes, args.repeats, timeout=1800)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    times, cold = results[0]["times"], results[0]["cold"]
    report(times, args.ranks, nbytes, args.repeats, cold)
    if args.json:
        record(times, args.ranks, nbytes, cold).write(
            args.json, ranks=args.ranks, size_mib=args.size_mib, repeats=args.repeats, cold=cold
        )


if __name__ == "__main__":
    main()
