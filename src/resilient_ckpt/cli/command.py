"""``resilient-ckpt``: list, verify, inspect and convert checkpoints; run the demo and benchmarks.

Argument parsing and the verbs; every verb is a thin layer over the other modules of this
package (see its docstring).

Errors are one line on stderr, ``resilient-ckpt <verb>: error: <what>``, where a file is
at fault naming the file and what is wrong with it; ``--debug`` (before or after the verb)
prints the traceback above it. Exit status 2 says a file could not be read at all (empty,
cut short, garbage, of the wrong kind, a directory that is no checkpoint, or refused as
unsafe: see ``--trust``) or the command line was wrong; 1 that a readable checkpoint failed
verification or the work failed otherwise (``ls --verify`` when any row failed, ``convert``
refusing a source that fails its checks). ``ls`` and ``verify`` go on past such a file
(it is listed as corrupt, the others are still listed and checked), then exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from ..errors import (
    CheckpointingException,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    VerificationFailedError,
)
from . import _trust, bench, checkpoints, converting

DESCRIPTION = (
    "resilient-ckpt: list, verify, inspect and convert checkpoints; run the demo and benchmarks."
)

# Exit statuses (see the module docstring).
OK, FAILED, BAD_INPUT = 0, 1, 2


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


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _error(args: argparse.Namespace, text: str) -> None:
    print(f"resilient-ckpt {args.command}: error: {_one_line(text)}", file=sys.stderr)


Failure = tuple[str, BaseException | None]  # a named error's text, and the error (--debug)


def _report_errors(args: argparse.Namespace, errors: Sequence[Failure], status: int) -> int:
    """Print each named error of a file met along the way; BAD_INPUT if there was any."""
    for text, exc in errors:
        if args.debug and exc is not None:
            traceback.print_exception(type(exc), exc, exc.__traceback__)
        _error(args, text)
    return BAD_INPUT if errors else status


def _cmd_ls(args: argparse.Namespace) -> int:
    if args.verify:
        total = sum(checkpoints.total_bytes(p) for p in args.paths)
        with _progress_bar(args, total, "verifying") as bar:
            entries = [
                e
                for p in args.paths
                for e in checkpoints.discover(
                    p, verify=True, progress=bar.update, trusted=args.trust
                )
            ]
    else:
        entries = [e for p in args.paths for e in checkpoints.discover(p, trusted=args.trust)]
    rows = [
        [
            e.kind,
            e.path,
            e.iteration if e.iteration is not None else "-",
            e.world_size if e.world_size is not None else "-",
            checkpoints.human(e.nbytes),
            "CORRUPT" if e.corrupt else "yes" if e.complete else "NO",
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
    failed = args.verify and any(e.verified is False for e in entries)
    return _report_errors(
        args, [(e.error, e.exc) for e in entries if e.error], FAILED if failed else OK
    )


_CHECKS = {
    "crc32": "every byte checksummed",
    "read": "no checksums recorded: sizes checked, every item read back",
    "load": "loaded with torch.load",
}


def _cmd_verify(args: argparse.Namespace) -> int:
    total = sum(checkpoints.total_bytes(p) for p in args.paths)
    reports: list[checkpoints.Report] = []
    errors: list[Failure] = []
    with _progress_bar(args, total, "verifying") as bar:
        for p in args.paths:
            found = checkpoints.verify_all(p, progress=bar.update, trusted=args.trust)
            if not found:
                errors.append((str(checkpoints.not_a_checkpoint(p)), None))
            reports.extend(found)
            errors.extend((r.error, r.exc) for r in found if r.error)
    ok = all(r.ok for r in reports) and bool(reports)
    if args.json:
        _emit(args, {"ok": ok, "checkpoints": [r.as_dict() for r in reports]}, None)
    for r in reports if not args.json else []:
        checks = f", {_CHECKS.get(r.checks, r.checks)}" if r.checks else ""
        status = "ok    " if r.ok else "FAILED"
        print(f"{status}  {r.kind:6s}  {r.path}  ({checkpoints.human(r.nbytes)}{checks})")
        for problem in r.problems:
            print(f"        - {problem}")
    if reports and not args.json:
        failed = sum(not r.ok for r in reports)
        print(f"{len(reports)} checkpoint(s) checked, {failed} failed")
    return _report_errors(args, errors, OK if ok else FAILED)


def _cmd_inspect(args: argparse.Namespace) -> int:
    tensors = checkpoints.inspect(args.path, trusted=args.trust)
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
    warnings: list[str] = []
    with _progress_bar(args, total, "converting") as bar:
        kind = converting.convert(
            args.src,
            args.dst,
            progress=bar.update,
            trusted=args.trust,
            ignore_checksums=args.ignore_checksums,
            warn=warnings.append,
        )
    for text in warnings:
        print(f"resilient-ckpt convert: warning: {_one_line(text)}", file=sys.stderr)
    nbytes = (
        sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(args.dst) for f in files)
        if os.path.isdir(args.dst)
        else os.path.getsize(args.dst)
    )
    result = {"src": args.src, "dst": args.dst, "conversion": kind, "bytes": nbytes}
    _emit(args, {**result, "verified": not warnings, "problems": warnings}, None)
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
    parser.add_argument(
        "--debug", action="store_true", default=default, help="print the traceback of an error"
    )


_PATHS_HELP = "checkpoints, or directories to search for them (a local path or msc://...)"


def _trust_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trust", action="store_true", help=_trust.TRUST_HELP)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="resilient-ckpt", description=DESCRIPTION)
    _common_options(parser, top=True)
    sub = parser.add_subparsers(
        dest="command",
        required=True,
        metavar="command",
        help="one of these; `resilient-ckpt <command> --help` says more",
    )
    p = sub.add_parser(
        "ls", help="list every checkpoint under directories (e.g. both tiers of a tiered one)"
    )
    p.add_argument("paths", nargs="+", metavar="path", help=_PATHS_HELP)
    p.add_argument(
        "--verify",
        action="store_true",
        help="also re-read and check every file; exit status 1 when any row fails",
    )
    _trust_option(p)
    p.set_defaults(func=_cmd_ls)
    p = sub.add_parser("verify", help="re-read every part; non-zero exit on any problem")
    p.add_argument("paths", nargs="+", metavar="path", help=_PATHS_HELP)
    _trust_option(p)
    p.set_defaults(func=_cmd_verify)
    p = sub.add_parser("inspect", help="tensor keys, shapes, dtypes and sizes")
    p.add_argument("path", help="a checkpoint: DCP directory, memory tier, local session, file")
    _trust_option(p)
    p.set_defaults(func=_cmd_inspect)
    p = sub.add_parser(
        "convert",
        help="DCP checkpoint, memory tier or local checkpoint -> torch.save file, or back",
    )
    p.add_argument(
        "src",
        help="a DCP checkpoint directory, a tiered memory tier (its newest complete step), a "
        "local checkpoint session or copy file, or a torch.save file",
    )
    p.add_argument(
        "dst", help="the torch.save file to write, or (from a torch.save file) an empty directory"
    )
    p.add_argument(
        "--ignore-checksums",
        action="store_true",
        help="convert a source that fails verification (sizes, checksums) anyway, with a "
        "warning: the output then holds the damaged bytes",
    )
    _trust_option(p)
    p.set_defaults(func=_cmd_convert)
    p = sub.add_parser(
        "prune",
        help="delete all but the newest N committed DCP checkpoints below a root, and the "
        "uncommitted ones older than the newest committed",
    )
    p.add_argument("path", help="the root directory holding one checkpoint per sub-directory")
    p.add_argument("--keep", type=int, default=1, help="committed checkpoints to keep (>= 1)")
    p.add_argument("--dry-run", action="store_true", help="say what would go, delete nothing")
    p.set_defaults(func=_cmd_prune)
    p = sub.add_parser(
        "bench",
        help="run the benchmarks with sensible defaults",
        description="Arguments after `--` go to the benchmark script (with --only NAME).",
    )
    p.add_argument("--only", help="comma-separated names: " + ",".join(bench.ALL_BENCHMARKS))
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
    except Exception as exc:  # every failure is one line; --debug shows where it came from
        if args.debug:
            traceback.print_exc()
        _error(args, _describe_error(exc))
        return _status_of(exc)


def _describe_error(exc: Exception) -> str:
    if isinstance(exc, CheckpointingException):
        return str(exc)
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    return f"{type(exc).__name__}: {exc} (unexpected: --debug shows where)"


def _status_of(exc: Exception) -> int:
    if isinstance(exc, VerificationFailedError):  # readable, but failed its checks
        return FAILED
    if isinstance(exc, (CorruptCheckpointError, UnsafeCheckpointError)):
        return BAD_INPUT
    return FAILED
