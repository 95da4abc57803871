"""Drives the demo: tiered checkpoints, a killed job, a lost node, an elastic restart.

Each job is a real ``torchrun --standalone`` launch of :mod:`.train` on CPU (gloo, a free
port). The story, in four launches after an uninterrupted reference run:

1. 4 ranks (two simulated nodes of 2) train, saving every step to the memory tier (in
   ``/dev/shm``, each rank's shard also copied to its peer on the other node) and every
   ``--durable-every`` steps to the durable tier too; every rank is SIGKILLed right after a
   save, as a failed job ends.
2. The memory directories of node 1 (ranks 2 and 3) are deleted, as if the node had been
   replaced, and the job restarts at 4 ranks: their shards come from the peers' copies.
   It is killed again a few steps later.
3. The job restarts at 2 ranks: the memory tier is read at a new world size (elastic).

The demo passes when the last run ends with weights bit-identical to the reference run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch


def _torchrun(nproc: int, *train_args: str, log: str | None = None) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={nproc}", "-m", "resilient_ckpt.demo.train", *train_args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if log is None:
        return subprocess.run(cmd, env=env, timeout=600).returncode
    with open(log, "w") as f:
        return subprocess.run(cmd, env=env, timeout=600, stdout=f, stderr=f).returncode


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _summary(work: str, name: str) -> dict[str, Any]:
    with open(os.path.join(work, f"{name}_summary.json")) as f:
        result: dict[str, Any] = json.load(f)
        return result


def _memory_base() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else ""


def _print_stalls(work: str, summary: dict[str, Any]) -> None:
    """Stalls of every save of the three checkpointing runs (rank 0), the killed ones too."""
    floor, nbytes = summary["memcpy_floor_s"], summary["shard_bytes"]
    with open(os.path.join(work, "saves.jsonl")) as f:
        saves = [json.loads(line) for line in f if line.strip()]
    firsts = [s["stall_s"] for s in saves if s["first"]]
    print(
        f"[demo] save stalls (rank 0, {len(saves)} saves over the three runs; the first save "
        f"of each run, after mgr.warmup(): {', '.join(f'{t * 1e3:.1f}' for t in firsts)} ms)"
    )
    for durable, label in ((False, "memory only"), (True, "memory + durable")):
        stalls = [s["stall_s"] for s in saves if s["durable"] is durable and not s["first"]]
        if stalls:
            median = statistics.median(stalls)
            print(
                f"[demo]   {label:16s}: {len(stalls):2d} saves, median stall "
                f"{median * 1e3:7.2f} ms (min {min(stalls) * 1e3:.2f}, max "
                f"{max(stalls) * 1e3:.2f})"
            )
    print(
        f"[demo]   reference: a memcpy of this rank's {nbytes:,} bytes (2 ranks) into shared "
        f"memory takes {floor * 1e3:.3f} ms"
    )


def _print_recovery(name: str, summary: dict[str, Any], what: str) -> None:
    resume = summary["resume"]
    print(
        f"[demo]   {name}: resumed at step {resume['step']} from the {resume['tier']} tier "
        f"in {resume['recovery_s']:.3f}s (load {resume['load_s']:.3f}s); {what}; "
        f"{resume['files_from_other_ranks_dirs']} data files came from other ranks' "
        "directories",
        flush=True,
    )


def _parse(argv: list[str] | None) -> argparse.Namespace:
    from ..cli._help import plain

    parser = argparse.ArgumentParser(prog="resilient-ckpt demo", description=plain(__doc__ or ""))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--durable-every", type=int, default=10)
    parser.add_argument("--crash-at-step", type=int, default=27, help="first kill")
    parser.add_argument("--second-crash-at-step", type=int, default=34, help="second kill")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    if not 0 < args.crash_at_step < args.second_crash_at_step < args.steps:
        parser.error("need 0 < --crash-at-step < --second-crash-at-step < --steps")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    work = args.workdir or tempfile.mkdtemp(prefix="resilient_ckpt_demo_")
    os.makedirs(work, exist_ok=True)
    memory = tempfile.mkdtemp(prefix="resilient_ckpt_demo_", dir=_memory_base() or work)
    durable = os.path.join(work, "durable")
    try:
        return _story(args, work, memory, durable)
    finally:
        shutil.rmtree(memory, ignore_errors=True)  # RAM, not disk: never leave it behind


def _job(args: argparse.Namespace, work: str, name: str, *extra: str) -> list[str]:
    return [
        "--saves-log",
        os.path.join(work, "saves.jsonl"),
        "--final",
        os.path.join(work, f"{name}_final.pt"),
        "--summary",
        os.path.join(work, f"{name}_summary.json"),
        "--steps",
        str(args.steps),
        "--durable-every",
        str(args.durable_every),
        *extra,
    ]


def _story(args: argparse.Namespace, work: str, memory: str, durable: str) -> int:
    # A reused --workdir starts over: no durable checkpoint or save log of an earlier demo.
    shutil.rmtree(durable, ignore_errors=True)
    if os.path.exists(os.path.join(work, "saves.jsonl")):
        os.unlink(os.path.join(work, "saves.jsonl"))
    dirs = ("--memory-dir", memory, "--durable-dir", durable)
    print(
        f"[demo] {args.steps} steps; every step saved to the memory tier {memory} (2 copies, "
        f"one per simulated node), every {args.durable_every}th also to the durable tier "
        f"{durable}",
        flush=True,
    )
    t0 = time.monotonic()
    print("[demo] 0/3 uninterrupted reference run, 4 ranks, no checkpoints", flush=True)
    if _torchrun(4, *_job(args, work, "ref", "--no-save")) != 0:
        print("[demo] FAILED: reference run did not finish", flush=True)
        return 1
    ok = True
    for phase, nproc, name, crash in (
        (1, 4, "first", args.crash_at_step),
        (2, 4, "second", args.second_crash_at_step),
    ):
        print(
            f"[demo] {phase}/3 {nproc} ranks, SIGKILLed on every rank at step {crash}", flush=True
        )
        log = os.path.join(work, f"{name}.log")
        code = _torchrun(
            nproc, *_job(args, work, name, *dirs, "--crash-at-step", str(crash)), log=log
        )
        ok = ok and code != 0
        print(
            f"[demo]     killed run exited with code {code} (non-zero expected; log {log}); "
            f"{time.monotonic() - t0:.0f}s so far"
        )
        if phase == 1:
            for rank in (2, 3):
                shutil.rmtree(os.path.join(memory, str(rank)), ignore_errors=True)
            print(f"[demo]     node loss: deleted {memory}/2 and {memory}/3 (node 1)", flush=True)
    print("[demo] 3/3 elastic restart on 2 ranks, to the end", flush=True)
    if _torchrun(2, *_job(args, work, "last", *dirs)) != 0:
        print("[demo] FAILED: the last run did not finish", flush=True)
        return 1
    ref = torch.load(os.path.join(work, "ref_final.pt"), weights_only=True)
    out = torch.load(os.path.join(work, "last_final.pt"), weights_only=True)
    same = ref.keys() == out.keys() and all(torch.equal(ref[k], out[k]) for k in ref)
    _report(work, memory, durable, same, time.monotonic() - t0)
    return 0 if same and ok else 1


def _report(work: str, memory: str, durable: str, same: bool, elapsed: float) -> None:
    last = _summary(work, "last")
    _print_stalls(work, last)
    print("[demo] recovery (rank 0):")
    _print_recovery("4 -> 4 ranks", _summary(work, "second"), "node 1's memory was lost")
    _print_recovery("4 -> 2 ranks", last, "elastic: shards re-cut for 2 ranks")
    print(
        f"[demo]   bytes: memory tier incl. replicas {_dir_bytes(memory):,}, durable tier "
        f"{_dir_bytes(durable):,}"
    )
    print(
        f"[demo] final weights bit-exact with the uninterrupted run: {same} ({elapsed:.1f}s total)",
        flush=True,
    )
