"""Drives the demo: a reference run, a run killed mid-training, node loss, a resumed run.

Each job is a real ``torchrun --standalone`` launch of :mod:`.train` on CPU (gloo). The
killed run dies by SIGKILL on every rank, as a failed node would end it; then the local
checkpoint directories of ranks 1 and 3 (one member of each replication clique) are
deleted, as if their nodes were replaced. The restart recovers their shards from peers.
The demo passes when the resumed run ends with weights bit-identical to the uninterrupted
run.
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

import torch


def _torchrun(nproc: int, *train_args: str, log: str | None = None) -> int:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "resilient_ckpt.demo.train",
        *train_args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if log is None:
        return subprocess.run(cmd, env=env, timeout=900).returncode
    with open(log, "w") as f:
        return subprocess.run(cmd, env=env, timeout=900, stdout=f, stderr=f).returncode


def _job(args: argparse.Namespace, work: str, name: str, **extra: str) -> list[str]:
    flags = [
        "--ckpt-dir",
        os.path.join(work, f"{name}_ckpt"),
        "--final",
        os.path.join(work, f"{name}_final.pt"),
        "--summary",
        os.path.join(work, f"{name}_summary.json"),
        "--steps",
        str(args.steps),
        "--dcp-every",
        str(args.dcp_every),
        "--local-every",
        str(args.local_every),
    ]
    for key, value in extra.items():
        flags += [f"--{key.replace('_', '-')}", value]
    return flags


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _print_summary(work: str, ckpt_dir: str, same: bool, elapsed: float) -> None:
    with open(os.path.join(work, "run_summary.json")) as f:
        resumed = json.load(f)
    floor = resumed["memcpy_floor_s"]
    print("[demo] saves of the resumed run (rank 0; write runs in the background worker)")
    for s in resumed["saves"]:
        print(
            f"[demo]   step {s['step']:3d} {s['kind']:5s}: stall {s['stall_s'] * 1e3:7.2f} ms  "
            f"write {s['write_s'] * 1e3:7.2f} ms  finalize {s['finalize_s'] * 1e3:6.2f} ms"
        )
    print("[demo] summary (rank 0 of the resumed run)")
    for kind in ("dcp", "local"):
        saves = [s for s in resumed["saves"] if s["kind"] == kind]
        if not saves:
            continue
        stall = statistics.median(s["stall_s"] for s in saves)
        print(
            f"[demo]   {kind:5s} saves: {len(saves):2d}, median stall "
            f"{stall * 1e3:6.2f} ms = {stall / floor:5.2f}x the memcpy floor "
            f"({floor * 1e3:.2f} ms for {saves[0]['bytes']:,} bytes)"
        )
    print(
        f"[demo]   bytes on disk: {_dir_bytes(ckpt_dir):,} "
        f"(DCP {_dir_bytes(os.path.join(ckpt_dir, 'dcp')):,}, "
        f"local incl. replicas {_dir_bytes(os.path.join(ckpt_dir, 'local')):,})"
    )
    resume = resumed["resume"]
    print(
        f"[demo]   recovery: resumed from {resume.get('source')} step "
        f"{max(resume['local_latest'], resume['dcp_latest'])} in "
        f"{resume.get('recovery_s', 0.0):.2f}s (ranks 1 and 3 had lost their local files)"
    )
    print(
        f"[demo] final weights bit-exact with the uninterrupted run: {same} ({elapsed:.1f}s total)",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="resilient-ckpt demo", description=__doc__)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--dcp-every", type=int, default=10)
    parser.add_argument("--local-every", type=int, default=2)
    parser.add_argument("--crash-at-step", type=int, default=27)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    if args.nproc % 2:
        parser.error("--nproc must be even (replication cliques of 2)")
    work = args.workdir or tempfile.mkdtemp(prefix="resilient_ckpt_demo_")
    print(
        f"[demo] workdir {work}; {args.nproc} CPU ranks (gloo), {args.steps} steps; async DCP "
        f"save every {args.dcp_every} steps, local save (replication factor 2) every "
        f"{args.local_every}",
        flush=True,
    )
    t0 = time.monotonic()
    print("[demo] 1/3 uninterrupted reference run", flush=True)
    if _torchrun(args.nproc, *_job(args, work, "ref")) != 0:
        print("[demo] FAILED: reference run did not finish", flush=True)
        return 1
    print(
        f"[demo] 2/3 training run, SIGKILLed on every rank at step {args.crash_at_step}", flush=True
    )
    log = os.path.join(work, "killed_run.log")
    code = _torchrun(
        args.nproc, *_job(args, work, "run", crash_at_step=str(args.crash_at_step)), log=log
    )
    print(
        f"[demo]     killed run ended with exit code {code} (expected non-zero); log: {log}",
        flush=True,
    )
    ckpt_dir = os.path.join(work, "run_ckpt")
    for rank in range(1, args.nproc, 2):
        shutil.rmtree(os.path.join(ckpt_dir, "local", "demo", str(rank)), ignore_errors=True)
    print(
        f"[demo]     node loss: deleted the local checkpoints of ranks "
        f"{list(range(1, args.nproc, 2))}",
        flush=True,
    )
    print("[demo] 3/3 restart: resume from the newest committed checkpoint", flush=True)
    if _torchrun(args.nproc, *_job(args, work, "run")) != 0:
        print("[demo] FAILED: resumed run did not finish", flush=True)
        return 1
    ref = torch.load(os.path.join(work, "ref_final.pt"))
    out = torch.load(os.path.join(work, "run_final.pt"))
    same = ref.keys() == out.keys() and all(torch.equal(ref[k], out[k]) for k in ref)
    _print_summary(work, ckpt_dir, same, time.monotonic() - t0)
    return 0 if same and code != 0 else 1
