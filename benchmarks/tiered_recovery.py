"""Recovery from the memory tier vs the durable tier (resilient_ckpt.cli.bench.tiered_recovery)."""

from __future__ import annotations

import sys

from resilient_ckpt.cli.bench.tiered_recovery import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
