"""Stall benchmark (issue 13); the code lives in :mod:`resilient_ckpt.cli.bench_stall`.

.venv/bin/python benchmarks/stall.py --ranks 2 --reps 6
"""

from __future__ import annotations

import sys

from resilient_ckpt.cli.bench_stall import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
