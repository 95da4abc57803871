"""NVRx ``test_cleanup.py``: an async local save, run with ``execute_sync``, retires the
previous iteration's file off the critical path (in one process, no process group), and
each save's finalize logs ``finalize_fn took <seconds>s`` at DEBUG, the line upstream's
test reads (checked in one process and on two ranks).

Upstream also asserts a time bound on the finalize step; timings are not asserted here
(they are benchmarks' business): the retired file is hidden at once and unlinked by a
background thread, which is what keeps finalize short.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from pathlib import Path

import pytest
import torch

from resilient_ckpt.local import BasicTensorAwareStateDict, LocalCheckpointManager, _deleter
from resilient_ckpt.testing import launch

pytestmark = pytest.mark.timeout(60)


def _state(iteration: int, tensors: int) -> BasicTensorAwareStateDict:
    return BasicTensorAwareStateDict(
        {"iteration": iteration, "t": [torch.full((16, 16), float(iteration))] * tensors}
    )


# The pattern upstream's test parses from the captured log text.
_FINALIZE_TIME = re.compile(r"finalize_fn took ([\d.]+)s")


def _finalize_times(records: list[logging.LogRecord]) -> list[float]:
    return [
        float(m.group(1))
        for r in records
        if r.levelno == logging.DEBUG and r.name.startswith("resilient_ckpt.local")
        for m in [_FINALIZE_TIME.search(r.getMessage())]
        if m is not None
    ]


def _leftovers(directory: Path, iteration: int) -> list[str]:
    return [n for n in os.listdir(directory) if f"iter_{iteration:07d}_" in n]


@pytest.mark.parametrize("use_ramdisk", [False, True])
def test_async_saves_retire_the_previous_iteration(tmp_path, use_ramdisk, caplog) -> None:
    """test_cleanup.py::TestLocalCheckpointing::test_basic_save_load_scenarios[True-False]
    and [True-True]"""
    if use_ramdisk and not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    with (
        tempfile.TemporaryDirectory(dir="/dev/shm" if use_ramdisk else tmp_path) as base,
        caplog.at_level(logging.DEBUG),
    ):
        root = Path(base) / "not" / "yet" / "there"  # created on demand
        manager = LocalCheckpointManager(root)
        paths = []
        for iteration in (1, 2):
            request = manager.save(_state(iteration, 10), iteration, is_async=True)
            request.execute_sync()
            path = manager._local_ckpt_path_from_id(manager._ckpt_id(iteration))
            assert path.exists()
            paths.append(path)
        assert not paths[0].exists()  # retired as soon as iteration 2 committed
        _deleter.wait_idle()  # the hidden file is unlinked by a background thread
        assert _leftovers(manager.local_ckpt_dir, 1) == []
        assert manager.find_latest() == 2
        loaded, ckpt_id = manager.load()
        assert ckpt_id == manager._ckpt_id(2)
        assert loaded.state_dict["iteration"] == 2
        assert torch.equal(loaded.state_dict["t"][0], torch.full((16, 16), 2.0))
    times = _finalize_times(caplog.records)
    assert len(times) == 2, caplog.text  # one finalize time logged per save


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _save_twice_and_read_the_log(rank: int, world_size: int, base: str) -> list[str]:
    # As pytest's caplog in each of upstream's ranks: a handler on the root logger.
    handler = _Records()
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    manager = LocalCheckpointManager(Path(base) / "ckpt")
    for iteration in (1, 2):
        manager.save(_state(iteration, 10), iteration, is_async=True).execute_sync()
    manager.save(_state(3, 10), 3)  # a synchronous save's finalize is timed too
    root.removeHandler(handler)
    return [r.getMessage() for r in handler.records if _finalize_times([r])]


def test_every_rank_logs_each_finalize_time(tmp_path) -> None:
    """test_cleanup.py::TestLocalCheckpointing::test_basic_save_load_scenarios (the log line
    it parses), on two ranks: the finalize is collective, each rank times its own."""
    lines = launch(_save_twice_and_read_the_log, 2, str(tmp_path), timeout=90)
    for rank, rank_lines in enumerate(lines):
        assert len(rank_lines) == 3, (rank, rank_lines)
        assert all(line.startswith(f"[rank {rank}] finalize_fn took ") for line in rank_lines)
