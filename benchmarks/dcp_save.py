"""Benchmark the async DCP save against dd, dcp.save and dcp.async_save, in one run.

For each world size (``--ranks``), ``--size`` bytes per rank (float32 DTensor shards, so
every rank writes its own bytes) are saved ``--reps`` times (after one warm-up save that
starts workers and fills caches) by:

* ours: ``save_state_dict_async_plan`` (plan cache on) + ``AsyncCallsQueue`` (persistent
  worker) + ``save_state_dict_async_finalize``; stall = plan + schedule (the trainer's
  blocking time), total = until finalize returned, write = the worker's write time;
* ``dcp.save`` with ``FileSystemWriter`` (same thread count, torch's plan caching on);
* ``dcp.async_save`` in process mode (``DefaultStager`` without pinned memory or
  non-blocking copies, as CPU requires; torch's plan caching on);
* ``dd if=/dev/zero bs=8M conv=fsync`` of the same total bytes into the same directory.

At the largest world size it also times planning alone, with and without the plan cache,
for a state of many small tensors. Every figure is printed next to its reference of the same
run, as a ratio, with medians over the repetitions. Not a test; run it on an idle machine:

    .venv/bin/python benchmarks/dcp_save.py --ranks 1,2,4 --size 256M --reps 3
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Figures
from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from resilient_ckpt.async_ckpt.state_dict_saver import (
    CheckpointMetadataCache,
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from resilient_ckpt.testing.launcher import launch

MiB = 1 << 20


@dataclass(frozen=True)
class Config:
    root: str
    nbytes: int
    tensors: int
    threads: int
    reps: int
    plan_tensors: int
    cpu_priority: int


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _sharded_state(rank: int, world: int, nbytes: int, tensors: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    cols = 1024
    rows = max(1, nbytes // tensors // 4 // cols)
    state: dict[str, Any] = {}
    for i in range(tensors):
        local = torch.rand(rows, cols, dtype=torch.float32)
        state[f"layer{i}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    state["step"] = 100
    return state


def _rmtree_on_rank0(rank: int, path: str) -> None:
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


class _Methods:
    """One save per method; each call returns its figures (seconds) for this rank."""

    def __init__(self, rank: int, world: int, cfg: Config) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.rank, self.world, self.cfg = rank, world, cfg
        self.state = _sharded_state(rank, world, cfg.nbytes, cfg.tensors)
        self.queue = AsyncCallsQueue(cpu_priority=cfg.cpu_priority)
        self.cache = CheckpointMetadataCache()
        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=False,
                use_shared_memory=True,
                use_async_staging=False,
                use_non_blocking_copy=False,
            )
        )

    def dd(self, rep: int) -> dict[str, float]:
        dist.barrier()
        if self.rank != 0:
            dist.barrier()
            return {}
        seconds = run_dd(self.cfg.root, self.world * per_rank_bytes(self.cfg))
        dist.barrier()
        return {"total": seconds}

    def ours(self, rep: int) -> dict[str, float]:
        path = os.path.join(self.cfg.root, f"ours{rep}")
        dist.barrier()
        started = time.perf_counter()
        writer = FileSystemWriterAsync(path, thread_count=self.cfg.threads)
        plan_ret = save_state_dict_async_plan(
            self.state, writer, enable_cache=True, metadata_cache=self.cache
        )
        save_fn, preload_fn, args = writer.get_save_function_and_args()
        finalize = functools.partial(save_state_dict_async_finalize, *plan_ret)
        idx = self.queue.schedule_async_request(
            AsyncRequest(save_fn, args, [finalize], preload_fn=preload_fn)
        )
        stall = time.perf_counter() - started
        self.queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
        total = time.perf_counter() - started
        _rmtree_on_rank0(self.rank, path)
        return {"stall": stall, "total": total, "write": self.queue.timings[idx]["write"]}

    def dcp_save(self, rep: int) -> dict[str, float]:
        path = os.path.join(self.cfg.root, f"dcp{rep}")
        dist.barrier()
        started = time.perf_counter()
        dcp.save(
            self.state,
            storage_writer=dcp.FileSystemWriter(path, thread_count=self.cfg.threads),
            planner=DefaultSavePlanner(enable_plan_caching=True),
        )
        total = time.perf_counter() - started
        _rmtree_on_rank0(self.rank, path)
        return {"total": total}

    def dcp_async(self, rep: int) -> dict[str, float]:
        path = os.path.join(self.cfg.root, f"adcp{rep}")
        dist.barrier()
        started = time.perf_counter()
        future = dcp.async_save(
            self.state,
            storage_writer=dcp.FileSystemWriter(path, thread_count=self.cfg.threads),
            planner=DefaultSavePlanner(enable_plan_caching=True),
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=self.stager,
        )
        stall = time.perf_counter() - started
        future.result()
        total = time.perf_counter() - started
        _rmtree_on_rank0(self.rank, path)
        return {"stall": stall, "total": total}

    def close(self) -> None:
        self.queue.close()
        self.stager.close()


def _rank_saves(rank: int, world: int, cfg: Config) -> dict[str, dict[str, list[float]]]:
    """Every method once per repetition, interleaved, so disk and load noise hits all alike;
    repetition 0 is a warm-up (workers start, arenas and caches fill)."""
    warnings.filterwarnings("ignore")
    methods = _Methods(rank, world, cfg)
    names = ("dd", "ours", "dcp_save", "dcp_async")
    out: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    for rep in range(cfg.reps + 1):
        for name in names:
            figures = getattr(methods, name)(rep)
            for key, value in figures.items():
                if rep:
                    out[name].setdefault(key, []).append(value)
    methods.close()
    return out


def _rank_plans(rank: int, world: int, cfg: Config) -> dict[str, list[float]]:
    warnings.filterwarnings("ignore")
    mesh = init_device_mesh("cpu", (world,))
    state: dict[str, Any] = {
        f"layer{i}.weight": DTensor.from_local(torch.zeros(4, 16), mesh, [Shard(0)])
        for i in range(cfg.plan_tensors)
    }
    state.update({f"extra{i}": i for i in range(cfg.plan_tensors // 8)})
    path = os.path.join(cfg.root, "plan")
    out: dict[str, list[float]] = {"uncached": [], "cached": []}
    for key, cache in (("uncached", None), ("cached", CheckpointMetadataCache())):
        for rep in range(cfg.reps + 2):
            dist.barrier()
            started = time.perf_counter()
            save_state_dict_async_plan(
                state,
                FileSystemWriterAsync(path),
                enable_cache=cache is not None,
                metadata_cache=cache,
            )
            if rep >= 2:  # the first two: warm-up, and the cache's one full planning
                out[key].append(time.perf_counter() - started)
    return out


# -- reference and reporting ----------------------------------------------------------------


def run_dd(directory: str, nbytes: int) -> float:
    """Seconds of ``dd if=/dev/zero bs=8M conv=fsync`` writing ``nbytes`` into ``directory``."""
    target = os.path.join(directory, "ddfile")
    count = max(1, nbytes // (8 * MiB))
    started = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={target}", "bs=8M", f"count={count}", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    seconds = time.perf_counter() - started
    os.unlink(target)
    return seconds


def crc32_gbps() -> float:
    data = memoryview(torch.rand(64 * MiB // 4).numpy()).cast("B")
    started = time.perf_counter()
    zlib.crc32(data)
    return data.nbytes / (time.perf_counter() - started) / 1e9


def _slowest(per_rank: list[dict], method: str, key: str) -> list[float]:
    """Per repetition, the slowest rank's figure (the job waits for it)."""
    reps = len(per_rank[0][method][key])
    return [max(r[method][key][i] for r in per_rank) for i in range(reps)]


_COLUMNS = "  {:<24} {:>9} {:<5} {:<22} {:>9} {:>6}  {}"


def _header(ours: str = "ours") -> str:
    return _COLUMNS.format("metric", ours, "", "reference", "ref", "ratio", "target")


def _row(metric: str, ours: float, ref_name: str, ref: float, unit: str, target: str) -> str:
    ratio = f"{ours / ref:.2f}" if ref else "n/a"
    return _COLUMNS.format(metric, f"{ours:.3f}", unit, ref_name, f"{ref:.3f}", ratio, target)


def report_saves(world: int, cfg: Config, per_rank: list[dict], figures: Figures) -> None:
    med = statistics.median
    total_bytes = world * per_rank_bytes(cfg)
    write_mbps = total_bytes / med(_slowest(per_rank, "ours", "write")) / 1e6
    dd_mbps = total_bytes / med(per_rank[0]["dd"]["total"]) / 1e6
    ours_stall = med(_slowest(per_rank, "ours", "stall"))
    ours_total = med(_slowest(per_rank, "ours", "total"))
    async_stall = med(_slowest(per_rank, "dcp_async", "stall"))
    async_total = med(_slowest(per_rank, "dcp_async", "total"))
    save_total = med(_slowest(per_rank, "dcp_save", "total"))
    print(
        f"\nranks={world}  bytes/rank={per_rank_bytes(cfg) / MiB:.0f} MiB  "
        f"threads={cfg.threads}  worker nice={cfg.cpu_priority}  reps={cfg.reps} "
        "(medians; slowest rank per rep)"
    )
    print(_header())
    print(_row("write throughput", write_mbps, "dd conv=fsync", dd_mbps, "MB/s", ">= 0.9"))
    print(
        _row("stall (plan+schedule)", ours_stall, "dcp.async_save stall", async_stall, "s", "< 1")
    )
    print(_row("total save", ours_total, "dcp.async_save total", async_total, "s", ""))
    print(_row("total save", ours_total, "dcp.save", save_total, "s", ""))
    print(_row("stall", ours_stall, "dcp.save (blocking)", save_total, "s", ""))
    case = f"{world} ranks x {per_rank_bytes(cfg) / MiB:.0f} MiB"
    figures.add(
        "throughput",
        case,
        "ours async DCP write",
        write_mbps / 1e3,
        "dd conv=fsync",
        dd_mbps / 1e3,
        ">= 0.9x",
    )
    figures.add("stall", case, "ours plan+schedule", ours_stall, "dcp.async_save", async_stall)
    figures.add("stall", case, "dcp.save (blocking)", save_total, "dcp.async_save", async_stall)


def report_raw(per_rank: list[dict]) -> None:
    """Every repetition's figure (slowest rank), to judge the noise behind the medians."""
    for method, figures in per_rank[0].items():
        for key in figures:
            values = _slowest(per_rank, method, key) if method != "dd" else figures[key]
            print(f"    raw {method}.{key}: " + " ".join(f"{v:.3f}" for v in values))


def per_rank_bytes(cfg: Config) -> int:
    cols, rows = 1024, max(1, cfg.nbytes // cfg.tensors // 4 // 1024)
    return cfg.tensors * rows * cols * 4


def report_plans(world: int, per_rank: list[dict], cfg: Config, figures: Figures) -> None:
    uncached = statistics.median(_slowest_plain(per_rank, "uncached"))
    cached = statistics.median(_slowest_plain(per_rank, "cached"))
    print(f"\nplanning only, ranks={world}, {cfg.plan_tensors} DTensors + objects, medians")
    print(_header("cached"))
    print(_row("plan time per save", cached, "uncached plan", uncached, "s", "<= 0.2"))
    figures.add(
        "stall",
        f"{world} ranks, {cfg.plan_tensors} tensors",
        "plan, cached",
        cached,
        "plan, uncached",
        uncached,
        "<= 0.2x",
    )


def _slowest_plain(per_rank: list[dict], key: str) -> list[float]:
    return [max(r[key][i] for r in per_rank) for i in range(len(per_rank[0][key]))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,2,4", help="world sizes, e.g. 1,2,4")
    parser.add_argument("--size", default="128M", help="bytes per rank, e.g. 256M, 1G")
    parser.add_argument("--tensors", type=int, default=16, help="tensors per rank")
    parser.add_argument("--threads", type=int, default=2, help="writer threads per rank")
    parser.add_argument("--reps", type=int, default=3, help="measured repetitions")
    parser.add_argument("--plan-tensors", type=int, default=512)
    parser.add_argument(
        "--cpu-priority", type=int, default=10, help="nice value of our worker (default 10)"
    )
    parser.add_argument("--dir", default=None, help="directory on the disk to measure")
    parser.add_argument("--raw", action="store_true", help="also print every repetition")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.ranks.split(",") if w.strip()]
    root = tempfile.mkdtemp(prefix="dcp_bench_", dir=args.dir)
    cfg = Config(
        root,
        parse_size(args.size),
        args.tensors,
        args.threads,
        args.reps,
        args.plan_tensors,
        args.cpu_priority,
    )
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, directory {root}")
    print(f"zlib.crc32 on one core: {crc32_gbps():.2f} GB/s (the writer checksums every byte)")
    figures = Figures("dcp_save")
    try:
        for world in worlds:
            per_rank = launch(_rank_saves, world, cfg, timeout=3600)
            report_saves(world, cfg, per_rank, figures)
            if args.raw:
                report_raw(per_rank)
        world = max(worlds)
        report_plans(world, launch(_rank_plans, world, cfg, timeout=1800), cfg, figures)
        figures.write(args.json, ranks=args.ranks, size=args.size, reps=args.reps)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
