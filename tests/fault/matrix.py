"""The fault matrix of issue 7 as data: scenario rows, their trial counts, how to run them.

Shared by ``tests/fault/test_matrix.py`` (which asserts every trial passed) and
``benchmarks/chaos.py`` (which runs more trials and prints a table). A *trial* is one
injected fault and every check that must hold after it; a scenario module runs many trials
in one multi-process job so that interpreter start-ups are paid once.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from resilient_ckpt.testing.faults import MountUnavailable, small_filesystem

from . import (
    scenario_bad_inputs,
    scenario_corrupt,
    scenario_soak,
    scenario_storage,
    scenario_trainer_kill,
    scenario_worker_kill,
)
from ._common import Trial

Rows = dict[str, list[Trial]]

# Trials per row in the default (make test) mode; --long and the chaos benchmark scale them.
DEFAULT = {
    "trainer_kill": 20,  # each also checks the killed trainers' workers: "trainer_kill_orphans"
    "worker_kill": 6,
    "write_raises": 13,  # one per phase of WRITE_CASES
    "disk_full": 3,
    "disk_full_injected": 2,
    "byte_flip": 5,  # one per case of FLIP_CASES
    "lose_dirs": 2,
    "slow_rank": 2,
    "soak": 100,  # consecutive saves (one trial)
}
TMPFS_BYTES = 24 << 20


@contextmanager
def disk(workdir: str) -> Iterator[str]:
    """A small tmpfs under ``workdir`` for ``disk_full`` (raises MountUnavailable)."""
    with small_filesystem(os.path.join(workdir, "tmpfs"), TMPFS_BYTES) as mount:
        yield mount


def _storage(workdir: str, n: dict[str, int], seed: int) -> Rows:
    counts = {k: n[k] for k in ("write_raises", "disk_full_injected", "slow_rank")}
    return scenario_storage.run(workdir, counts, seed)


def _disk_full(workdir: str, n: dict[str, int], seed: int) -> Rows:
    with disk(workdir) as mount:
        return scenario_storage.run(workdir, {"disk_full": n["disk_full"]}, seed, mount=mount)


SCENARIOS: dict[str, Callable[[str, dict[str, int], int], Rows]] = {
    "trainer_kill": lambda d, n, s: scenario_trainer_kill.run(d, n["trainer_kill"], s),
    "worker_kill": lambda d, n, s: scenario_worker_kill.run(d, n["worker_kill"], s),
    "storage": _storage,
    "disk_full": _disk_full,
    "corrupt": lambda d, n, s: scenario_corrupt.run(
        d, {"byte_flip": n["byte_flip"], "lose_dirs": n["lose_dirs"]}, s
    ),
    "soak": lambda d, n, s: scenario_soak.run(d, n["soak"]),
    "bad_inputs": lambda d, n, s: scenario_bad_inputs.run(d),
}


def counts(scale: float = 1.0) -> dict[str, int]:
    """Trials per row, ``scale`` times the default (at least one each; soak stays >= 100)."""
    scaled = {row: max(1, round(n * scale)) for row, n in DEFAULT.items()}
    scaled["soak"] = max(DEFAULT["soak"], scaled["soak"])
    return scaled


__all__ = ["DEFAULT", "SCENARIOS", "MountUnavailable", "Rows", "counts", "disk"]
