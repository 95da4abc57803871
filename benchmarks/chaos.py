"""Chaos benchmark: the fault matrix of ``tests/fault`` for many trials, as a table.

Runs every scenario with ``--scale`` times the trial counts of the test suite (or the rows
named by ``--only``) and prints, per matrix row: trials, passed, hangs (a trial whose job
did not finish by its deadline), and the longest time from the fault to the error every
rank raised (or, where no error is expected, to the checked outcome). Exit status 1 if any
trial failed. The machine is shared: times are indicative.

    .venv/bin/python benchmarks/chaos.py --scale 2
    .venv/bin/python benchmarks/chaos.py --only trainer_kill,worker_kill --scale 5
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.fault import matrix
from tests.fault._common import Trial

# The suite's deadlines (tests/conftest.py): short enough that a hang shows quickly.
for _name, _value in (
    ("WORKER_START", "90"),
    ("FINALIZE", "60"),
    ("COLLECTIVE", "90"),
    ("SHUTDOWN", "20"),
):
    os.environ.setdefault(f"RESILIENT_CKPT_{_name}_TIMEOUT", _value)


def _row(name: str, trials: list[Trial]) -> str:
    seconds = max((t.seconds or 0.0) for t in trials) if trials else 0.0
    passed = sum(t.passed for t in trials)
    hangs = sum(t.hung for t in trials)
    return f"{name:<22} {len(trials):>6} {passed:>6} {hangs:>5} {seconds:>13.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="trials per row, as a multiple of the test suite's (default 1)",
    )
    parser.add_argument(
        "--only", default="", help="comma-separated scenarios: " + ", ".join(matrix.SCENARIOS)
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--verbose", action="store_true", help="print failed trials")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(matrix.SCENARIOS)
    unknown = sorted(set(names) - set(matrix.SCENARIOS))
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; choose from {list(matrix.SCENARIOS)}")
    counts = matrix.counts(args.scale)
    print(f"{'scenario':<22} {'trials':>6} {'passed':>6} {'hangs':>5} {'max s to error':>13}")
    failed = False
    started = time.monotonic()
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"chaos-{name}-") as workdir:
            try:
                rows = matrix.SCENARIOS[name](workdir, counts, args.seed)
            except matrix.MountUnavailable as exc:
                print(f"{name:<22} skipped: {exc}")
                continue
        for row, trials in rows.items():
            print(_row(row, trials), flush=True)
            bad = [t for t in trials if not t.passed]
            failed = failed or bool(bad)
            if args.verbose:
                for t in bad:
                    print(f"    {'HUNG ' if t.hung else ''}{t.detail[:2000]}")
    print(f"total {time.monotonic() - started:.0f}s, scale {args.scale}, seed {args.seed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
