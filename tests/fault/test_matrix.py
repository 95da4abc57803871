"""The fault matrix (issue 7), one test per scenario; ``--long`` runs 3x the trials."""

from __future__ import annotations

import pytest

from . import matrix
from ._common import summarize

pytestmark = pytest.mark.fault


@pytest.fixture
def trial_counts(request: pytest.FixtureRequest) -> dict[str, int]:
    return matrix.counts(3.0 if request.config.getoption("--long") else 1.0)


def _check(rows: matrix.Rows, expected: dict[str, int]) -> None:
    for row, trials in rows.items():
        want = 1 if row == "soak" else expected.get(row, 1)  # soak: one trial of N saves
        assert len(trials) >= want, f"{row}: only {len(trials)} trials ran"
        assert all(t.passed for t in trials), f"{row}: {summarize(trials)}"


@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    "scenario", ["trainer_kill", "worker_kill", "storage", "corrupt", "soak", "bad_inputs"]
)
def test_fault_matrix(scenario: str, tmp_path, trial_counts) -> None:
    rows = matrix.SCENARIOS[scenario](str(tmp_path), trial_counts, 0)
    _check(rows, trial_counts)


@pytest.mark.timeout(300)
def test_disk_full_on_a_small_tmpfs(tmp_path, trial_counts) -> None:
    try:
        rows = matrix.SCENARIOS["disk_full"](str(tmp_path), trial_counts, 0)
    except matrix.MountUnavailable as exc:
        pytest.skip(f"no size-limited file system for the disk-full row: {exc}")
    _check(rows, trial_counts)
