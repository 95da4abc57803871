"""The shipped test launcher: a rank that sent its result but does not exit costs a grace
period, not the rest of the deadline."""

from __future__ import annotations

import time

import pytest

from resilient_ckpt.testing import launcher
from tests import _helpers


@pytest.mark.timeout(120)
def test_rank_lingering_after_its_result_is_killed_after_the_grace(monkeypatch, caplog) -> None:
    monkeypatch.setattr(launcher, "TEARDOWN_GRACE_S", 2.0)
    started = time.monotonic()
    results = launcher.launch(
        _helpers.result_then_linger, 2, 600.0, timeout=90, process_group=False
    )
    assert results == [0, 10]
    assert time.monotonic() - started < 45  # not the 90 s deadline, nor the 600 s linger
    assert "did not exit" in caplog.text
