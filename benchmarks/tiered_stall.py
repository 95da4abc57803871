"""Tiered checkpointing: the stall of a save that also goes durable vs a memory-only save.

Issue 14, behaviour 1: a save stages the state once; the memory-tier write, the replicas and
(every ``durable_every``-th save) the durable write all come from that snapshot, so the
trainer stall of a durable save should be at most 1.1x that of a memory-only one.

Runs ``--ranks`` gloo ranks on this machine (memory tier in ``/dev/shm``, durable tier in a
temporary directory on disk), each with a state of ``--size-mib`` MiB, and makes
``--saves`` saves with ``durable_every=2`` (so they alternate). Before each save the
previous one is waited for (untimed), so every save starts from an idle pipeline; the stall
is the wall time of ``save()``. Printed per rank 0: the median stall of each kind, their
ratio, and a same-run reference: a single-thread copy of the same bytes into pre-allocated
memory (``copy_``), which is what staging has to do at least.

Usage: ``python benchmarks/tiered_stall.py [--ranks 2] [--size-mib 64] [--saves 10]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import make_state
from resilient_ckpt.testing import launch
from resilient_ckpt.tiered import TieredCheckpointManager


def _job(rank: int, world: int, memory_dir: str, durable_dir: str, nbytes: int, saves: int):
    state = make_state(nbytes)
    mgr = TieredCheckpointManager(
        memory_dir,
        durable_dir,
        replication_factor=2 if world % 2 == 0 else 1,
        replication_jump=max(1, world // 2),
        durable_every=2,
        keep_memory=2,
        keep_durable=1,
    )
    stalls: dict[str, list[float]] = {"memory": [], "durable": []}
    for step in range(1, saves + 1):
        for t in state.values():
            t.add_(1.0)
        started = time.perf_counter()
        mgr.save(state, step)
        stall = time.perf_counter() - started
        mgr.maybe_finalize(blocking=True)
        if step > 2:  # the first two pay the worker start and the full planning
            stalls["durable" if step % 2 == 0 else "memory"].append(stall)
    mgr.close()
    dst = {k: torch.empty_like(v) for k, v in state.items()}
    copies = []
    for _ in range(5):
        started = time.perf_counter()
        for k, v in state.items():
            dst[k].copy_(v)
        copies.append(time.perf_counter() - started)
    return {k: statistics.median(v) for k, v in stalls.items()} | {
        "memcpy": statistics.median(copies)
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--saves", type=int, default=10)
    args = parser.parse_args(argv)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    memory_dir = tempfile.mkdtemp(prefix="rc_tiered_bench_", dir=shm)
    durable_dir = tempfile.mkdtemp(prefix="rc_tiered_bench_durable_")
    try:
        results: list[dict[str, Any]] = launch(
            _job,
            args.ranks,
            memory_dir,
            durable_dir,
            args.size_mib << 20,
            args.saves,
            timeout=1800,
        )
    finally:
        shutil.rmtree(memory_dir, ignore_errors=True)
        shutil.rmtree(durable_dir, ignore_errors=True)
    print(f"tiered save stall, {args.ranks} ranks x {args.size_mib} MiB, medians per rank")
    print(
        f"{'rank':>4} {'memory-only s':>14} {'durable s':>10} {'ratio':>6} {'memcpy s':>9}"
        f" {'memory/memcpy':>14}"
    )
    for rank, r in enumerate(results):
        print(
            f"{rank:>4} {r['memory']:>14.4f} {r['durable']:>10.4f} "
            f"{r['durable'] / r['memory']:>6.2f} {r['memcpy']:>9.4f} "
            f"{r['memory'] / r['memcpy']:>14.2f}"
        )
    print("target: durable / memory-only <= 1.1 (issue 14, behaviour 1)")


if __name__ == "__main__":
    main()
