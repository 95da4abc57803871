"""Drives the demo: a reference run, a run killed mid-training, a resumed run, a comparison.

Each job is a real ``torchrun --standalone`` launch of :mod:`.train` on CPU; the killed run
dies by SIGKILL on every rank, exactly as a node failure would end it. The demo passes when
the resumed run ends with weights bit-identical to the uninterrupted run.
"""

from __future__ import annotations

import argparse
import os
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
        return subprocess.run(cmd, env=env, timeout=600).returncode
    with open(log, "w") as f:
        return subprocess.run(cmd, env=env, timeout=600, stdout=f, stderr=f).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="resilient-ckpt demo", description=__doc__)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--crash-at-step", type=int, default=23)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    work = args.workdir or tempfile.mkdtemp(prefix="resilient_ckpt_demo_")
    common = ["--steps", str(args.steps), "--save-every", str(args.save_every)]
    print(
        f"[demo] workdir {work}; {args.nproc} CPU ranks (gloo), {args.steps} steps, "
        f"async checkpoint every {args.save_every} steps",
        flush=True,
    )

    t0 = time.monotonic()
    print("[demo] 1/3 uninterrupted reference run", flush=True)
    if (
        _torchrun(
            args.nproc,
            "--ckpt-dir",
            os.path.join(work, "ref_ckpt"),
            "--final",
            os.path.join(work, "ref_final.pt"),
            *common,
        )
        != 0
    ):
        print("[demo] FAILED: reference run did not finish", flush=True)
        return 1
    ckpt_dir = os.path.join(work, "ckpt")
    print(
        f"[demo] 2/3 training run, SIGKILLed on every rank at step {args.crash_at_step}", flush=True
    )
    code = _torchrun(
        args.nproc,
        "--ckpt-dir",
        ckpt_dir,
        "--final",
        os.path.join(work, "final.pt"),
        "--crash-at-step",
        str(args.crash_at_step),
        *common,
        log=os.path.join(work, "killed_run.log"),
    )
    print(
        f"[demo]     killed run ended with exit code {code} (expected non-zero); "
        f"its log: {os.path.join(work, 'killed_run.log')}",
        flush=True,
    )
    print("[demo] 3/3 restart: resume from the last committed checkpoint", flush=True)
    if (
        _torchrun(
            args.nproc, "--ckpt-dir", ckpt_dir, "--final", os.path.join(work, "final.pt"), *common
        )
        != 0
    ):
        print("[demo] FAILED: resumed run did not finish", flush=True)
        return 1
    ref = torch.load(os.path.join(work, "ref_final.pt"))
    out = torch.load(os.path.join(work, "final.pt"))
    same = ref.keys() == out.keys() and all(torch.equal(ref[k], out[k]) for k in ref)
    print(
        f"[demo] final weights bit-exact with the uninterrupted run: {same} "
        f"({time.monotonic() - t0:.1f}s total)",
        flush=True,
    )
    return 0 if same and code != 0 else 1
