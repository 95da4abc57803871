"""Lightning's tiered callback on a GPU with NCCL (runs only with a GPU): a one-device DDP
fit saving every step leaves training as without the callback, and a second fit resumes
from the memory tier to an uninterrupted fit's weights (tests/_lightning_resume.py)."""

from __future__ import annotations

import importlib.util

import pytest

from resilient_ckpt.testing import launch
from tests._lightning_resume import FIRST, job

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        importlib.util.find_spec("lightning") is None, reason="needs the lightning extra"
    ),
]


def test_one_device_fit_resumes_from_the_memory_tier(tmp_path) -> None:
    (facts,) = launch(job, 1, str(tmp_path), "gpu", "nccl", timeout=220, process_group=False)
    assert facts["untouched"], facts
    assert facts["resumed"] is not None and facts["resumed"]["step"] == FIRST, facts
    assert facts["resumed"]["tier"] == "memory", facts
    assert facts["exact"], facts
