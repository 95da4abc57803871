"""Local checkpoint benchmark; the code lives in :mod:`resilient_ckpt.cli.bench.local_load`
(``resilient-ckpt bench --only local_ckpt`` runs the same from an installed package).

Usage: ``python benchmarks/local_ckpt.py [--ranks 4] [--size-mib 256] [--repeats 3]
[--root DIR] [--json PATH]``
"""

from __future__ import annotations

import sys

from resilient_ckpt.cli.bench.local_load import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
