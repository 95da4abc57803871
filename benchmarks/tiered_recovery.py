"""Tiered checkpointing: recovery after a node loss (memory tier vs durable, cold) and the
stall of a save that also goes durable. The benchmark lives in the package
(:mod:`resilient_ckpt.cli.tiered_bench`, where its design is described) so that an installed
``resilient-ckpt bench --only tiered_recovery`` runs the same code.

Usage: ``python benchmarks/tiered_recovery.py [--ranks 4] [--size-mib 64] [--repeats 3]``
"""

from __future__ import annotations

import sys

from resilient_ckpt.cli.tiered_bench import main

if __name__ == "__main__":
    sys.exit(main())
