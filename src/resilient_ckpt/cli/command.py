"""``resilient-ckpt``: list, verify, inspect and convert checkpoints; run the demo and benchmarks.

Argument parsing and the verbs; every verb is a thin layer over the other modules of this
package (see its docstring).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from ..errors import CheckpointingException
from . import bench, checkpoints


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
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip())
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def _progress_bar(args: argparse.Namespace, total: int, desc: str) -> Any:
    """A byte-counting tqdm bar on stderr; off with --json / --no-progress or off a TTY."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        leave=False,
        disable=True if (args.json or args.no_progress) else None,
    )


def _cmd_ls(args: argparse.Namespace) -> int:
    if args.verify:
        total = sum(checkpoints.total_bytes(p) for p in args.paths)
        with _progress_bar(args, total, "verifying") as bar:
            entries = [
                e
                for p in args.paths
                for e in checkpoints.discover(p, verify=True, progress=bar.update)
            ]
    else:
        entries = [e for p in args.paths for e in checkpoints.discover(p)]
    rows = [
        [
            e.kind,
            e.path,
            e.iteration if e.iteration is not None else "-",
            e.world_size if e.world_size is not None else "-",
            checkpoints.human(e.nbytes),
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
        print(f"no checkpoints under {' '.join(args.paths)}")
    return 0


_CHECKS = {
    "crc32": "every byte checksummed",
    "read": "no checksums recorded: sizes checked, every item read back",
    "load": "loaded with torch.load",
}


def _cmd_verify(args: argparse.Namespace) -> int:
    total = sum(checkpoints.total_bytes(p) for p in args.paths)
    with _progress_bar(args, total, "verifying") as bar:
        reports = [r for p in args.paths for r in checkpoints.verify_all(p, progress=bar.update)]
    ok = all(r.ok for r in reports) and bool(reports)
    if args.json:
        _emit(args, {"ok": ok, "checkpoints": [r.as_dict() for r in reports]}, None)
    for r in reports if not args.json else []:
        checks = f", {_CHECKS.get(r.checks, r.checks)}" if r.checks else ""
        status = "ok    " if r.ok else "FAILED"
        print(f"{status}  {r.kind:6s}  {r.path}  ({checkpoints.human(r.nbytes)}{checks})")
        for problem in r.problems:
            print(f"        - {problem}")
    if not reports:
        print(f"no checkpoint found at {' '.join(args.paths)}", file=sys.stderr)
    elif not args.json:
        failed = sum(not r.ok for r in reports)
        print(f"{len(reports)} checkpoint(s) checked, {failed} failed")
    return 0 if ok else 1


def _cmd_inspect(args: argparse.Namespace) -> int:
    tensors = checkpoints.inspect(args.path)
    rows = [
        [
            t["key"],
            t["dtype"],
            "x".join(map(str, t["shape"])) or "scalar",
            checkpoints.human(t["nbytes"]),
        ]
        for t in tensors
    ]
    _emit(args, tensors, rows, ["key", "dtype", "shape", "bytes"])
    if not args.json:
        print(f"{len(tensors)} tensors, {checkpoints.human(sum(t['nbytes'] for t in tensors))}")
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    total = 2 * checkpoints.total_bytes(args.src)  # read once, written once
    with _progress_bar(args, total, "converting") as bar:
        kind = checkpoints.convert(args.src, args.dst, progress=bar.update)
    nbytes = (
        sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(args.dst) for f in files)
        if os.path.isdir(args.dst)
        else os.path.getsize(args.dst)
    )
    _emit(args, {"src": args.src, "dst": args.dst, "conversion": kind, "bytes": nbytes}, None)
    if not args.json:
        print(f"converted {args.src} -> {args.dst} ({kind}, {checkpoints.human(nbytes)})")
    return 0


def _cmd_prune(args: argparse.Namespace) -> int:
    from ..storage.retention import prune_checkpoints

    doomed = prune_checkpoints(args.path, keep_latest=args.keep, dry_run=args.dry_run)
    _emit(args, {"deleted": [] if args.dry_run else doomed, "would_delete": doomed}, None)
    if not args.json:
        verb = "would delete" if args.dry_run else "deleted"
        for path in doomed:
            print(f"{verb}  {path}")
        print(f"{len(doomed)} checkpoint(s) {verb}; the newest {args.keep} committed kept")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from ..demo.orchestrate import main as demo_main

    return demo_main(args.demo_args)


def _common_options(parser: argparse.ArgumentParser, top: bool) -> None:
    # Accepted before and after the verb; after it, an absent flag must not reset the value
    # given before it, hence SUPPRESS there.
    default: Any = False if top else argparse.SUPPRESS
    parser.add_argument("--json", action="store_true", default=default, help="JSON on stdout")
    parser.add_argument(
        "--no-progress", action="store_true", default=default, help="no progress bar"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="resilient-ckpt", description=__doc__.splitlines()[0])
    _common_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "ls", help="list every checkpoint under directories (e.g. both tiers of a tiered one)"
    )
    p.add_argument("paths", nargs="+", metavar="path")
    p.add_argument("--verify", action="store_true", help="also re-read and check every file")
    p.set_defaults(func=_cmd_ls)
    p = sub.add_parser("verify", help="re-read every part; non-zero exit on any problem")
    p.add_argument("paths", nargs="+", metavar="path")
    p.set_defaults(func=_cmd_verify)
    p = sub.add_parser("inspect", help="tensor keys, shapes, dtypes and sizes")
    p.add_argument("path")
    p.set_defaults(func=_cmd_inspect)
    p = sub.add_parser("convert", help="DCP or local checkpoint -> torch.save file, or back")
    p.add_argument("src")
    p.add_argument("dst")
    p.set_defaults(func=_cmd_convert)
    p = sub.add_parser(
        "prune", help="delete all but the newest N committed DCP checkpoints below a root"
    )
    p.add_argument("path")
    p.add_argument("--keep", type=int, default=1, help="committed checkpoints to keep (>= 1)")
    p.add_argument("--dry-run", action="store_true", help="say what would go, delete nothing")
    p.set_defaults(func=_cmd_prune)
    p = sub.add_parser(
        "bench",
        help="run the benchmarks with sensible defaults",
        description="Arguments after `--` go to the benchmark script (with --only NAME).",
    )
    p.add_argument("--only", help="comma-separated names: " + ",".join(bench.DEFAULT_BENCHMARKS))
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    p.add_argument("--dir", help="directory on the storage to measure (default: a temp dir)")
    p.add_argument("--plot", metavar="PNG", help="draw stall and throughput against references")
    p.add_argument(
        "--markdown",
        action="store_true",
        help="print the figures as Markdown tables with the command and the machine",
    )
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(func=bench.run)
    p = sub.add_parser("demo", help="what `make demo` runs (see `demo --help`)", add_help=False)
    p.add_argument("demo_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_demo)
    for name, subparser in sub.choices.items():
        if name != "demo":
            _common_options(subparser, top=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (CheckpointingException, FileNotFoundError) as exc:
        print(f"resilient-ckpt {args.command}: {exc}", file=sys.stderr)
        return 1
