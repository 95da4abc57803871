"""The shipped test launcher: a rank that sent its result but does not exit costs a grace
period, not the rest of the deadline; ranks see the environment of their launch."""

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


@pytest.mark.timeout(180)
def test_ranks_see_the_environment_of_their_launch_and_spawn_runs_start_up_hooks(
    monkeypatch,
) -> None:
    """Forked from the preloaded server, a rank still gets the environment of the moment it
    is launched (the server's own is older); start-up hooks, such as the NVRx alias that
    RESILIENT_CKPT_NVRX_ALIAS switches on, need a new interpreter: start_method="spawn"."""
    launcher.launch(_helpers.environment_and_alias, 1, "RC_LAUNCH_PROBE", process_group=False)
    for value in ("first", "second"):
        monkeypatch.setenv("RC_LAUNCH_PROBE", value)
        got = launcher.launch(
            _helpers.environment_and_alias, 2, "RC_LAUNCH_PROBE", process_group=False
        )
        assert [seen for seen, _ in got] == [value, value]
    monkeypatch.setenv("RESILIENT_CKPT_NVRX_ALIAS", "1")
    spawned = launcher.launch(
        _helpers.environment_and_alias,
        1,
        "RC_LAUNCH_PROBE",
        process_group=False,
        start_method="spawn",
    )
    assert spawned == [("second", True)]
    with pytest.raises(ValueError, match="start_method"):
        launcher.launch(_helpers.environment_and_alias, 1, "x", start_method="fork")
