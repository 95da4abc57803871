"""The batches of ``lightning_job.py``: a pure function of (step, rank), importable without
Lightning (the test recomputes the uninterrupted run from them)."""

from __future__ import annotations

import torch


def batch_for(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=gen)
    return x, x.sum(dim=1, keepdim=True).sin()
