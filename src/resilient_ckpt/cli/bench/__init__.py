"""``resilient-ckpt bench``: the benchmarks, run from the installed package on the user's disk.

Each benchmark is a module of the package with a ``main(argv)`` that prints its own tables
(every figure next to its reference of the same run) and writes its figures with ``--json``:

* ``stall`` (:mod:`resilient_ckpt.cli.bench_stall`): the trainer's stall per save for three
  state shapes, against a single-thread memcpy of the same bytes and ``dcp.async_save``;
* ``local_ckpt`` (:mod:`.local_load`): local checkpoint save against ``dd conv=fsync``, load
  against a raw cold read of the same files, and load after losing a clique member;
* ``dcp_load`` (:mod:`.dcp_load`): ``dcp.load`` with our reader against torch's;
* ``tiered_recovery`` (:mod:`.tiered_recovery`): restore after a node loss, durable stall;
  with ``-- --durable s3`` its durable tier is ``restore_scale``'s bandwidth-limited store;
* ``restore_scale`` (:mod:`.restore_scale`, only with ``--only``: it needs ``moto[server]``
  and the ``msc`` extra): read-once restores from a bandwidth-limited object store at
  2 to 16 ranks, and the census of a steady save's collectives, projected to large jobs.

This module chooses the arguments (``--quick`` for a short run, ``--dir`` for the storage
to measure), runs the benchmarks one after the other in this process (each spawns its ranks)
and, with ``--plot``, hands the figures to :mod:`..bench_plot`; with ``--markdown`` it prints
them as Markdown tables (:mod:`.markdown`) for the docs' performance page. ``benchmarks/*.py``
of a checkout are thin wrappers around the same modules.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import tempfile
from typing import Any

from ._output import progress

DEFAULT_BENCHMARKS = ["stall", "local_ckpt", "dcp_load", "tiered_recovery"]

_MODULES = {
    "stall": "resilient_ckpt.cli.bench_stall",
    "local_ckpt": "resilient_ckpt.cli.bench.local_load",
    "dcp_load": "resilient_ckpt.cli.bench.dcp_load",
    "tiered_recovery": "resilient_ckpt.cli.bench.tiered_recovery",
    "restore_scale": "resilient_ckpt.cli.bench.restore_scale",
}
ALL_BENCHMARKS = list(_MODULES)


def bench_defaults(name: str, quick: bool) -> list[str]:
    """Arguments of each benchmark for ``resilient-ckpt bench [--quick]``."""
    if not quick:
        return []  # the benchmark's own defaults
    if name == "stall":
        return [
            *("--ranks", "2", "--reps", "3", "--warmups", "1"),
            *("--memory-saves", "10", "--first-trials", "1"),
        ]
    if name == "local_ckpt":
        return ["--ranks", "2", "--size-mib", "32", "--repeats", "3"]
    if name == "dcp_load":
        return ["--ranks", "2", "--size", "32M", "--repeats", "3"]
    if name == "tiered_recovery":
        return ["--ranks", "2", "--size-mib", "16", "--repeats", "2"]
    if name == "restore_scale":
        return ["--quick"]
    return []


def _run_one(name: str, argv: list[str], out: Any) -> int:
    module = importlib.import_module(_MODULES[name])
    with contextlib.redirect_stdout(out):
        code = module.main(argv)
    out.flush()
    return int(code or 0)


def command_line(args: argparse.Namespace) -> list[str]:
    """The ``resilient-ckpt bench`` command that reproduces this run (for ``--markdown``)."""
    argv = ["resilient-ckpt", "bench"]
    if args.markdown:
        argv.append("--markdown")
    if args.quick:
        argv.append("--quick")
    if args.only:
        argv += ["--only", args.only]
    if args.dir is not None:
        argv += ["--dir", args.dir]
    extra = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    return argv + (["--", *extra] if extra else [])


def run(args: argparse.Namespace) -> int:
    """``resilient-ckpt bench``: each benchmark in turn, tables printed, figures collected."""
    names = args.only.split(",") if args.only else DEFAULT_BENCHMARKS
    extra = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    if extra and len(names) != 1:
        print("extra benchmark arguments need --only with one benchmark", file=sys.stderr)
        return 2
    unknown = [n for n in names if n not in _MODULES]
    if unknown:
        print(f"no benchmark {unknown}; choose from {', '.join(_MODULES)}", file=sys.stderr)
        return 2
    if args.dir is not None and not os.path.isdir(args.dir):
        print(f"--dir {args.dir}: not a directory", file=sys.stderr)
        return 2
    if args.json and args.markdown:
        print("--json and --markdown both write stdout: choose one", file=sys.stderr)
        return 2
    if args.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            print("--plot needs matplotlib: pip install 'resilient-ckpt[plot]'", file=sys.stderr)
            return 2
    results = []
    # With --json or --markdown stdout carries only that document; the tables go to stderr.
    out = sys.stderr if args.json or args.markdown else sys.stdout
    with tempfile.TemporaryDirectory(prefix="rc_bench_json_") as tmp:
        for number, name in enumerate(names, 1):
            progress(f"benchmark {number} of {len(names)}: {name}")
            json_path = os.path.join(tmp, f"{name}.json")
            argv = [*bench_defaults(name, args.quick), *extra]
            if args.dir is not None:
                argv += ["--dir", args.dir]
            print(f"$ python -m {_MODULES[name]} {' '.join(argv)}", file=out, flush=True)
            code = _run_one(name, [*argv, "--json", json_path], out)
            if code != 0:
                print(f"benchmark {name} failed with exit code {code}", file=sys.stderr)
                return 1
            if os.path.exists(json_path):
                with open(json_path) as f:
                    results.append(json.load(f))
    if args.plot:
        from .. import bench_plot

        drawn = bench_plot.plot(results, args.plot)
        print(f"plotted {drawn} figures to {args.plot}", file=out)
    if args.json:
        print(json.dumps(results, indent=2))
    if args.markdown:
        from . import markdown

        print(markdown.render(results, command_line(args)), end="")
    return 0
