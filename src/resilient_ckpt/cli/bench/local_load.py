"""Local checkpoint benchmark: save against ``dd``, load against a raw cold read, recovery.

Runs N ranks (gloo, spawned by ``resilient_ckpt.testing.launch``) on this machine, each with
a state of ``--size-mib`` MiB in 16 tensors, in a fresh directory under ``--dir``, and prints
every figure next to its reference measured in the same run (medians of ``--repeats``):

* save (synchronous, fsync) against ``dd if=/dev/zero bs=8M conv=fsync`` of the same bytes
  on every rank at once (target >= 0.9 as throughput);
* save with replication factor 2 against save without replication;
* trainer stall of an async save (persistent queue), with and without replication;
* ``find_latest() + load()`` (checksums verified) against a raw read of the very files the
  load reads (8 MiB ``readinto``, what ``dd bs=8M`` does), both from the disk: before each
  sample every rank evicts its files from the page cache (see :func:`.common.evict`)
  (target >= 0.8 as throughput);
* load after deleting the whole directory of one member of every clique (its shard comes
  from a peer) against a normal load of the same replicated checkpoint (target <= 1.5).

Samples of a figure and of its reference alternate, so the noise of a shared machine hits
both alike. Times are job times: from a barrier before the operation to a barrier after it.

Usage: ``python -m resilient_ckpt.cli.bench.local_load [--ranks 4] [--size-mib 256]
[--repeats 3] [--dir DIR] [--json PATH]``
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ...async_ckpt.core import AsyncCallsQueue
from ...local import (
    BasicTensorAwareStateDict,
    CliqueReplicationStrategy,
    LocalCheckpointManager,
    _deleter,
)
from ...testing import launch
from .._help import plain
from ._output import progress, verdict
from .common import Figures, evict, raw_read

TENSORS = 16


def make_state(rank: int, nbytes: int) -> dict[str, Any]:
    per = max(1, nbytes // TENSORS // 4)
    g = torch.Generator().manual_seed(rank)
    layers = {f"layer{i}": torch.rand(per, generator=g) for i in range(TENSORS)}
    return {"model": layers, "step": 0, "rank": rank}


def _settle() -> None:
    """Let the previous operation's background deletions and dirty pages finish first."""
    _deleter.wait_idle()
    os.sync()


def _timed(fn: Callable[[], Any], before: Callable[[], Any] | None = None) -> float:
    _settle()
    if before is not None:
        before()
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _copies(directory: str) -> list[str]:
    return sorted(glob.glob(os.path.join(directory, "*_local.pt")))


class _Bench:
    def __init__(self, rank: int, world: int, root: str, nbytes: int, repeats: int) -> None:
        self.rank, self.world, self.root = rank, world, root
        self.nbytes, self.repeats = nbytes, repeats
        self.state = make_state(rank, nbytes)
        self.iteration = 0
        self.samples: dict[str, list[float]] = {}

    def add(self, name: str, seconds: float) -> None:
        self.samples.setdefault(name, []).append(seconds)

    def times(self) -> dict[str, float]:
        return {k: statistics.median(v) for k, v in self.samples.items()}

    def dd_write(self) -> None:
        path = os.path.join(self.root, f"dd-{self.rank}.bin")
        count = max(1, self.nbytes // (8 << 20))
        cmd = ["dd", "if=/dev/zero", f"of={path}", "bs=8M", f"count={count}", "conv=fsync"]
        for _ in range(self.repeats):
            seconds = _timed(lambda: subprocess.run(cmd, check=True, capture_output=True))
            self.add("raw write", seconds * self.nbytes / (count * (8 << 20)))
            os.unlink(path)

    def save(self, name: str, mgr: LocalCheckpointManager) -> None:
        def _save() -> None:
            self.iteration += 1
            mgr.save(BasicTensorAwareStateDict(self.state), self.iteration)

        _save()  # warm-up: directories, process groups
        for _ in range(self.repeats):
            self.add(name, _timed(_save))

    def stall(self, name: str, mgr: LocalCheckpointManager, queue: AsyncCallsQueue) -> None:
        samples = []
        for _ in range(self.repeats + 1):
            _settle()
            dist.barrier()
            self.iteration += 1
            start = time.perf_counter()
            request = mgr.save(BasicTensorAwareStateDict(self.state), self.iteration, True)
            if request is None:
                raise RuntimeError("an async save returned no request")
            queue.schedule_async_request(request)
            samples.append(time.perf_counter() - start)
            queue.maybe_finalize_async_calls(blocking=True)
        worst = torch.tensor(samples[1:])  # the first one starts the worker
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        self.samples[name] = worst.tolist()

    def load_vs_raw(self, name: str, root: str, strategy: Any) -> None:
        """Cold load and cold raw read of the files the load reads, alternating."""
        mine = os.path.join(root, "bench", str(self.rank))
        own = [p for p in _copies(mine) if f"_{self.rank}_local.pt" in os.path.basename(p)]

        def _load() -> None:
            mgr = LocalCheckpointManager(root, "bench", strategy)
            if mgr.find_latest() == -1:
                raise RuntimeError("no checkpoint found")
            mgr.load()

        for _ in range(self.repeats):
            self.add(f"raw read {name}", _timed(lambda: raw_read(own), lambda: evict(own)))
            self.add(name, _timed(_load, lambda: evict(_copies(mine))))

    def lost_load(self, name: str, root: str, strategy: Any, lose: Sequence[int]) -> None:
        mine = os.path.join(root, "bench", str(self.rank))
        backup = os.path.join(self.root, f"backup-{self.rank}")

        def _load() -> None:
            mgr = LocalCheckpointManager(root, "bench", strategy)
            if mgr.find_latest() == -1:
                raise RuntimeError("no checkpoint found")
            mgr.load()

        def _lose() -> None:
            if self.rank in lose:
                shutil.move(mine, backup)
            else:
                evict(_copies(mine))

        for _ in range(self.repeats):
            self.add(name, _timed(_load, _lose))
            dist.barrier()
            if self.rank in lose:
                shutil.rmtree(mine, ignore_errors=True)
                shutil.move(backup, mine)


def _quiet(text: str) -> None:
    return None


def _run(rank: int, world: int, root: str, nbytes: int, repeats: int) -> dict[str, float]:
    bench = _Bench(rank, world, root, nbytes, repeats)
    say = progress if rank == 0 else _quiet
    say("local_ckpt: raw write (dd), then saves")
    bench.dd_write()
    plain_root, repl_root = os.path.join(root, "plain"), os.path.join(root, "repl")
    clique = CliqueReplicationStrategy.from_replication_params(1, 2)
    plain = LocalCheckpointManager(plain_root, "bench")
    repl = LocalCheckpointManager(repl_root, "bench", clique)
    bench.save("save", plain)
    bench.save("save F=2", repl)
    say("local_ckpt: async stalls")
    queue = AsyncCallsQueue(persistent=True)
    try:
        bench.stall("stall", plain, queue)
        bench.stall("stall F=2", repl, queue)
    finally:
        queue.close()
    say("local_ckpt: loads against raw reads, then a load with members lost")
    bench.load_vs_raw("load", plain_root, None)
    bench.load_vs_raw("load F=2", repl_root, clique)
    bench.lost_load("load F=2, 1 lost/clique", repl_root, clique, range(1, world, 2))
    return bench.times()


def _row(
    name: str, seconds: float, gbps: float | None, ref: str = "", ratio: str = "", target: str = ""
) -> str:
    rate = f"{gbps:7.2f}" if gbps is not None else " " * 7
    mark = f"  {verdict(target, float(ratio))}" if target and ratio else ""
    return f"{name:<34} {seconds:8.3f} {rate}  {ref:<28} {ratio:>6}{mark}".rstrip()


def report(t: dict[str, float], ranks: int, nbytes: int, repeats: int) -> None:
    total = ranks * nbytes / 1e9
    head = f"{'figure':<34} {'seconds':>8} {'GB/s':>7}  {'reference':<28} {'ratio':>6}"
    print(f"\nLocal checkpoint, {ranks} ranks x {nbytes / 2**20:g} MiB, median of {repeats}")
    print("\nSave (synchronous, fsync); ratio = throughput / reference (target >= 0.9)\n" + head)
    print(_row("raw write (dd bs=8M conv=fsync)", t["raw write"], total / t["raw write"]))
    save_ratio = f"{t['raw write'] / t['save']:.2f}"
    print(
        _row(
            "save, no replication", t["save"], total / t["save"], "raw write", save_ratio, ">= 0.9"
        )
    )
    f2 = f"{t['save F=2'] / t['save']:.2f}"
    print(_row("save, replication F=2 (time)", t["save F=2"], None, "save, no replication", f2))
    print(_row("async stall, no replication", t["stall"], None))
    sf2 = f"{t['stall F=2'] / t['stall']:.2f}"
    print(_row("async stall, F=2 (time)", t["stall F=2"], None, "async stall, no repl", sf2))
    print(
        "\nLoad from disk (page cache evicted; find_latest + load, checksums verified);\n"
        "ratio = throughput / raw read of the same files (target >= 0.8)\n" + head
    )
    for name in ("load", "load F=2"):
        raw = t[f"raw read {name}"]
        print(_row(f"raw read ({name} files)", raw, total / raw))
        print(_row(name, t[name], total / t[name], "raw read", f"{raw / t[name]:.2f}", ">= 0.8"))
    lost = t["load F=2, 1 lost/clique"]
    print("\nRecovery; ratio = time / normal load (target <= 1.5)\n" + head)
    lost_ratio = f"{lost / t['load F=2']:.2f}"
    print(
        _row("load, 1 member/clique deleted", lost, total / lost, "load F=2", lost_ratio, "<= 1.5")
    )


def record(t: dict[str, float], ranks: int, nbytes: int) -> Figures:
    """The figures of the printed tables, in GB/s over all ranks' bytes."""
    figures, total = Figures("local_ckpt"), ranks * nbytes / 1e9
    case = f"{ranks} ranks x {nbytes / 2**20:g} MiB"
    add = figures.add
    add(
        "throughput", case, "local save", total / t["save"], "dd conv=fsync", total / t["raw write"]
    )
    add("throughput", case, "local save F=2", total / t["save F=2"], "save", total / t["save"])
    for name in ("load", "load F=2"):
        raw = total / t[f"raw read {name}"]
        add("throughput", case, f"local {name}", total / t[name], "raw cold read", raw, ">= 0.8x")
    lost = t["load F=2, 1 lost/clique"]
    add(
        "throughput",
        case,
        "local load, 1 lost/clique",
        total / lost,
        "load F=2",
        total / t["load F=2"],
    )
    add("stall", case, "local async save, F=2", t["stall F=2"], "no replication", t["stall"])
    return figures


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=plain((__doc__ or "").split("\n")[0]))
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--size-mib", type=float, default=256, help="state bytes per rank")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--dir", "--root", dest="dir", default=None, help="directory on the disk to measure"
    )
    p.add_argument("--json", default=None, help="also write the figures to this file")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.ranks < 2 or args.ranks % 2:
        parser().error("--ranks must be even and >= 2 (replication factor 2)")
    nbytes = int(args.size_mib * 2**20)
    root = tempfile.mkdtemp(prefix="rc_local_bench_", dir=args.dir)
    try:
        times = launch(
            _run, args.ranks, root, nbytes, args.repeats, timeout=3600, start_method="spawn"
        )[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(times, args.ranks, nbytes, args.repeats)
    record(times, args.ranks, nbytes).write(
        args.json, ranks=args.ranks, size_mib=args.size_mib, repeats=args.repeats
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
