"""``resilient-ckpt``: list, verify, inspect and convert checkpoints; run the demo and benchmarks.

Every verb prints a table for people and, with ``--json`` (before or after the verb), one
JSON document on stdout for programs. Long work (``verify``, ``ls --verify``, ``convert``)
shows a progress bar on stderr when stderr is a terminal (``--no-progress`` hides it; it is
never shown with ``--json``). Exit status: 0 on success, 1 when a checkpoint fails
verification or a run fails, 2 on bad usage. The verbs work on DCP checkpoint directories
(ours and plain ``dcp.save`` ones), local per-rank checkpoints (``LocalCheckpointManager``'s
root or a session directory) and ``torch.save`` files.

The command is a thin layer: what a checkpoint is and how it is checked lives in
``_catalog`` (and ``_catalog_local``, ``_convert``); benchmark runs and plots in
``_bench_plot`` and the scripts of ``benchmarks/``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
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
        with _progress_bar(args, _catalog.total_bytes(args.path), "verifying") as bar:
            entries = _catalog.discover(args.path, verify=True, progress=bar.update)
    else:
        entries = _catalog.discover(args.path)
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


_CHECKS = {
    "crc32": "every byte checksummed",
    "read": "no checksums recorded: sizes checked, every item read back",
    "load": "loaded with torch.load",
}


def _cmd_verify(args: argparse.Namespace) -> int:
    with _progress_bar(args, _catalog.total_bytes(args.path), "verifying") as bar:
        reports = _catalog.verify_all(args.path, progress=bar.update)
    ok = all(r.ok for r in reports) and bool(reports)
    if args.json:
        _emit(args, {"ok": ok, "checkpoints": [r.as_dict() for r in reports]}, None)
    for r in reports if not args.json else []:
        checks = f", {_CHECKS.get(r.checks, r.checks)}" if r.checks else ""
        status = "ok    " if r.ok else "FAILED"
        print(f"{status}  {r.kind:5s}  {r.path}  ({_catalog.human(r.nbytes)}{checks})")
        for problem in r.problems:
            print(f"        - {problem}")
    if not reports:
        print(f"no checkpoint found at {args.path}", file=sys.stderr)
    elif not args.json:
        failed = sum(not r.ok for r in reports)
        print(f"{len(reports)} checkpoint(s) checked, {failed} failed")
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
    total = 2 * _catalog.total_bytes(args.src)  # read once, written once
    with _progress_bar(args, total, "converting") as bar:
        kind = _catalog.convert(args.src, args.dst, progress=bar.update)
    nbytes = (
        sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(args.dst) for f in files)
        if os.path.isdir(args.dst)
        else os.path.getsize(args.dst)
    )
    _emit(args, {"src": args.src, "dst": args.dst, "conversion": kind, "bytes": nbytes}, None)
    if not args.json:
        print(f"converted {args.src} -> {args.dst} ({kind}, {_catalog.human(nbytes)})")
    return 0


def _cmd_prune(args: argparse.Namespace) -> int:
    from .storage.retention import prune_checkpoints

    doomed = prune_checkpoints(args.path, keep_latest=args.keep, dry_run=args.dry_run)
    _emit(args, {"deleted": [] if args.dry_run else doomed, "would_delete": doomed}, None)
    if not args.json:
        verb = "would delete" if args.dry_run else "deleted"
        for path in doomed:
            print(f"{verb}  {path}")
        print(f"{len(doomed)} checkpoint(s) {verb}; the newest {args.keep} committed kept")
    return 0


def _bench_dir() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [
        os.path.join(os.getcwd(), "benchmarks"),
        os.path.join(os.path.dirname(os.path.dirname(here)), "benchmarks"),
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


def _cmd_bench(args: argparse.Namespace) -> int:
    bench_dir = _bench_dir()
    if bench_dir is None:
        print("benchmarks/ not found: run from a checkout of resilient_ckpt", file=sys.stderr)
        return 2
    names = args.only.split(",") if args.only else _catalog.DEFAULT_BENCHMARKS
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
            cmd = [sys.executable, script, *_catalog.bench_defaults(name, args.quick), *extra]
            print(f"$ {' '.join(cmd)}", file=out, flush=True)
            code = _run_streaming([*cmd, "--json", json_path], out)
            if code != 0:
                print(f"benchmark {name} failed with exit code {code}", file=sys.stderr)
                return 1
            with open(json_path) as f:
                results.append(json.load(f))
    if args.plot:
        from . import _bench_plot

        drawn = _bench_plot.plot(results, args.plot)
        print(f"plotted {drawn} figures to {args.plot}", file=out)
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo.orchestrate import main as demo_main

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
    p.add_argument("--only", help="comma-separated names: " + ",".join(_catalog.DEFAULT_BENCHMARKS))
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    p.add_argument("--plot", metavar="PNG", help="draw stall and throughput against references")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_bench)
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


if __name__ == "__main__":
    raise SystemExit(main())
