"""Suite-wide settings: short deadlines, marker-based skips for what this machine lacks."""

from __future__ import annotations

import os

import pytest
import torch

# Deadlines short enough that a hang fails fast, long enough for a loaded 2-core machine
# (a spawned worker imports torch in a few seconds).
os.environ.setdefault("RESILIENT_CKPT_WORKER_START_TIMEOUT", "90")
os.environ.setdefault("RESILIENT_CKPT_FINALIZE_TIMEOUT", "60")
os.environ.setdefault("RESILIENT_CKPT_COLLECTIVE_TIMEOUT", "90")
os.environ.setdefault("RESILIENT_CKPT_SHUTDOWN_TIMEOUT", "20")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--long",
        action="store_true",
        default=False,
        help="fault matrix: run 3x the trials per scenario (tests/fault)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
