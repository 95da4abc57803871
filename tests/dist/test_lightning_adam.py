"""Lightning's tiered callback with Adam, one CPU device (gloo): the callback leaves
training as it would be without it (torch's get_state_dict gives an empty Adam state a
zero-lr step, which would start its step counter at 1), and a second fit resumes from the
memory tier to an uninterrupted fit's weights, bit for bit (tests/_lightning_resume.py)."""

from __future__ import annotations

import importlib.util

import pytest

from resilient_ckpt.testing import launch
from tests._lightning_resume import FIRST, job

pytestmark = [
    pytest.mark.dist,
    pytest.mark.timeout(180),
    pytest.mark.skipif(
        importlib.util.find_spec("lightning") is None, reason="needs the lightning extra"
    ),
]


def test_adam_fit_is_untouched_by_the_callback_and_resumes_exactly(tmp_path) -> None:
    (facts,) = launch(job, 1, str(tmp_path), "cpu", "gloo", timeout=150, process_group=False)
    assert facts["untouched"], facts
    assert facts["resumed"] is not None and facts["resumed"]["step"] == FIRST, facts
    assert facts["resumed"]["tier"] == "memory", facts
    assert facts["exact"], facts
