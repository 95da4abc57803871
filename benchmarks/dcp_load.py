"""DCP load benchmark; the code lives in :mod:`resilient_ckpt.cli.bench.dcp_load`
(``resilient-ckpt bench --only dcp_load`` runs the same from an installed package).

Usage: ``python benchmarks/dcp_load.py [--ranks 2] [--size 128M] [--repeats 3] [--dir DIR]``
"""

from __future__ import annotations

import sys

from resilient_ckpt.cli.bench.dcp_load import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
