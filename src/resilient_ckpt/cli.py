"""``resilient-ckpt``: list, verify, inspect and convert checkpoints; run the demo and benchmarks.

Every verb prints a table for people and, with ``--json``, one JSON document for programs.
Exit status: 0 on success, 1 when a checkpoint fails verification or a run fails, 2 on bad
usage. The verbs work on DCP checkpoint directories (ours and plain ``dcp.save`` ones),
local per-rank checkpoints (``LocalCheckpointManager``'s root) and ``torch.save`` files.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from . import _catalog
from .errors import CheckpointingException


def _emit(
    args: argparse.Namespace,
    payload: Any,
    table: list[list[Any]] | None,
    header: Sequence[str] = (),
) -> None:
    if args.json:
        print(json.dumps(payload, indent=2, default=str))
        return
    if table is None:
        return
    rows = [[str(c) for c in row] for row in table]
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)
    ]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))


def _cmd_ls(args: argparse.Namespace) -> int:
    entries = _catalog.discover(args.path, verify=args.verify)
    rows = [
        [
            e.kind,
            e.path,
            e.iteration if e.iteration is not None else "-",
            e.world_size if e.world_size is not None else "-",
            _catalog.human(e.nbytes),
            "yes" if e.complete else "NO",
            {True: "ok", False: "FAILED", None: "-"}[e.verified],
        ]
        for e in entries
    ]
    _emit(
        args,
        [e.as_dict() for e in entries],
        rows,
        ["kind", "path", "iteration", "world", "bytes", "complete", "verified"],
    )
    if not entries and not args.json:
        print(f"no checkpoints under {args.path}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    reports = _catalog.verify_all(args.path, progress=not args.json)
    ok = all(r.ok for r in reports) and bool(reports)
    rows = [
        [r.kind, r.path, "ok" if r.ok else "FAILED", "; ".join(r.problems) or "-"] for r in reports
    ]
    _emit(
        args,
        {"ok": ok, "checkpoints": [r.as_dict() for r in reports]},
        rows,
        ["kind", "path", "status", "problems"],
    )
    if not reports:
        print(f"no checkpoint found at {args.path}", file=sys.stderr)
    return 0 if ok else 1


def _cmd_inspect(args: argparse.Namespace) -> int:
    tensors = _catalog.inspect(args.path)
    rows = [
        [
            t["key"],
            t["dtype"],
            "x".join(map(str, t["shape"])) or "scalar",
            _catalog.human(t["nbytes"]),
        ]
        for t in tensors
    ]
    _emit(args, tensors, rows, ["key", "dtype", "shape", "bytes"])
    if not args.json:
        print(f"{len(tensors)} tensors, {_catalog.human(sum(t['nbytes'] for t in tensors))}")
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    kind = _catalog.convert(args.src, args.dst)
    _emit(args, {"src": args.src, "dst": args.dst, "conversion": kind}, None)
    if not args.json:
        print(f"converted {args.src} -> {args.dst} ({kind})")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [
        os.path.join(os.getcwd(), "benchmarks"),
        os.path.join(os.path.dirname(os.path.dirname(here)), "benchmarks"),
    ]
    bench_dir = next((c for c in candidates if os.path.isdir(c)), None)
    if bench_dir is None:
        print("benchmarks/ not found: run from a checkout of resilient_ckpt", file=sys.stderr)
        return 2
    names = args.only.split(",") if args.only else _catalog.DEFAULT_BENCHMARKS
    code = 0
    for name in names:
        script = os.path.join(bench_dir, f"{name}.py")
        if not os.path.exists(script):
            print(f"no benchmark {name!r} in {bench_dir}", file=sys.stderr)
            return 2
        cmd = [sys.executable, script, *_catalog.bench_defaults(name, args.quick)]
        if args.plot:
            cmd += ["--plot", args.plot.replace(".png", f"_{name}.png")]
        print(f"$ {' '.join(cmd)}", flush=True)
        code = code or subprocess.run(cmd).returncode
    return code


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo.orchestrate import main as demo_main

    return demo_main(args.demo_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="resilient-ckpt", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ls", help="list every checkpoint under a directory")
    p.add_argument("path")
    p.add_argument("--verify", action="store_true", help="also re-read and check every file")
    p.set_defaults(func=_cmd_ls)
    p = sub.add_parser("verify", help="re-read every part; non-zero exit on any problem")
    p.add_argument("path")
    p.set_defaults(func=_cmd_verify)
    p = sub.add_parser("inspect", help="tensor keys, shapes, dtypes and sizes")
    p.add_argument("path")
    p.set_defaults(func=_cmd_inspect)
    p = sub.add_parser("convert", help="DCP or local checkpoint -> torch.save file, or back")
    p.add_argument("src")
    p.add_argument("dst")
    p.set_defaults(func=_cmd_convert)
    p = sub.add_parser("bench", help="run the benchmarks with sensible defaults")
    p.add_argument("--only", help="comma-separated benchmark names")
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    p.add_argument("--plot", help="draw figures to this PNG (one file per benchmark)")
    p.set_defaults(func=_cmd_bench)
    p = sub.add_parser("demo", help="what `make demo` runs")
    p.add_argument("demo_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except CheckpointingException as exc:
        print(f"resilient-ckpt {args.command}: {exc}", file=sys.stderr)
        return 1
    except FileNotFoundError as exc:
        print(f"resilient-ckpt {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
