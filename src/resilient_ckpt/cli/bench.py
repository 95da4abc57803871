"""``resilient-ckpt bench``: run the scripts of ``benchmarks/`` with sensible defaults.

Each script prints its own tables (streamed as they appear) and writes its figures with
``--json``; this module only chooses the arguments (``--quick`` for a short run), runs the
scripts one after the other and, with ``--plot``, hands the figures to :mod:`.bench_plot`.
The scripts are found in ``./benchmarks`` or next to the source tree of a checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

DEFAULT_BENCHMARKS = ["async_save", "dcp_save", "local_ckpt", "tiered_recovery"]


def bench_defaults(name: str, quick: bool) -> list[str]:
    """Arguments of each benchmark script for ``resilient-ckpt bench [--quick]``."""
    if name == "async_save":
        return ["--sizes", "64M" if quick else "64M,512M", "--repeats", "3" if quick else "5"]
    if not quick:
        return []  # the script's own defaults
    if name == "dcp_save":
        return ["--ranks", "2", "--size", "32M", "--reps", "2", "--plan-tensors", "128"]
    if name == "local_ckpt":
        return ["--ranks", "2", "--size-mib", "32", "--repeats", "2"]
    if name == "tiered_recovery":
        return ["--ranks", "2", "--size-mib", "16", "--repeats", "2"]
    return []


def _bench_dir() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [
        os.path.join(os.getcwd(), "benchmarks"),
        os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(here))), "benchmarks"),
    ]
    return next((c for c in candidates if os.path.isdir(c)), None)


def _run_streaming(cmd: list[str], out: Any) -> int:
    """Run ``cmd`` with its stdout going to ``out``: straight to its file descriptor when it
    has one (tables appear as they are printed), else copied when it ends (pytest's capture,
    an io.StringIO)."""
    try:
        fd = out.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        fd = None
    if fd is not None:
        out.flush()
        return subprocess.run(cmd, stdout=fd).returncode
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    out.write(done.stdout)
    return done.returncode


def run(args: argparse.Namespace) -> int:
    """``resilient-ckpt bench``: each script in turn, tables streamed, figures collected."""
    bench_dir = _bench_dir()
    if bench_dir is None:
        print("benchmarks/ not found: run from a checkout of resilient_ckpt", file=sys.stderr)
        return 2
    names = args.only.split(",") if args.only else DEFAULT_BENCHMARKS
    extra = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    if extra and len(names) != 1:
        print("extra benchmark arguments need --only with one benchmark", file=sys.stderr)
        return 2
    for name in names:
        if not os.path.exists(os.path.join(bench_dir, f"{name}.py")):
            print(f"no benchmark {name!r} in {bench_dir}", file=sys.stderr)
            return 2
    if args.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            print("--plot needs matplotlib: pip install 'resilient-ckpt[plot]'", file=sys.stderr)
            return 2
    results = []
    # With --json stdout carries only the JSON document; the tables go to stderr.
    out = sys.stderr if args.json else sys.stdout
    with tempfile.TemporaryDirectory(prefix="rc_bench_json_") as tmp:
        for name in names:
            json_path = os.path.join(tmp, f"{name}.json")
            script = os.path.join(bench_dir, f"{name}.py")
            cmd = [sys.executable, script, *bench_defaults(name, args.quick), *extra]
            print(f"$ {' '.join(cmd)}", file=out, flush=True)
            code = _run_streaming([*cmd, "--json", json_path], out)
            if code != 0:
                print(f"benchmark {name} failed with exit code {code}", file=sys.stderr)
                return 1
            with open(json_path) as f:
                results.append(json.load(f))
    if args.plot:
        from . import bench_plot

        drawn = bench_plot.plot(results, args.plot)
        print(f"plotted {drawn} figures to {args.plot}", file=out)
    if args.json:
        print(json.dumps(results, indent=2))
    return 0
