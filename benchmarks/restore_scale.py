"""Read-once restores behind a bandwidth-limited object store, and the coordination census of
a steady save; the code lives in :mod:`resilient_ckpt.cli.bench.restore_scale`
(``resilient-ckpt bench --only restore_scale`` runs the same from an installed package).

Usage: ``python benchmarks/restore_scale.py [--quick] [--ranks 2,4,8] [--with-16]``
"""

from __future__ import annotations

import sys

from resilient_ckpt.cli.bench.restore_scale import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
