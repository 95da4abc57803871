"""NVRx ``test_cleanup.py``: an async local save, run with ``execute_sync``, retires the
previous iteration's file off the critical path (in one process, no process group).

Upstream also asserts a time bound on the finalize step; timings are not asserted here
(they are benchmarks' business): the retired file is hidden at once and unlinked by a
background thread, which is what keeps finalize short.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from resilient_ckpt.local import BasicTensorAwareStateDict, LocalCheckpointManager, _deleter

pytestmark = pytest.mark.timeout(60)


def _state(iteration: int, tensors: int) -> BasicTensorAwareStateDict:
    return BasicTensorAwareStateDict(
        {"iteration": iteration, "t": [torch.full((16, 16), float(iteration))] * tensors}
    )


def _leftovers(directory: Path, iteration: int) -> list[str]:
    return [n for n in os.listdir(directory) if f"iter_{iteration:07d}_" in n]


@pytest.mark.parametrize("use_ramdisk", [False, True])
def test_async_saves_retire_the_previous_iteration(tmp_path, use_ramdisk) -> None:
    """test_cleanup.py::TestLocalCheckpointing::test_basic_save_load_scenarios[True-False]
    and [True-True]"""
    if use_ramdisk and not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    with tempfile.TemporaryDirectory(dir="/dev/shm" if use_ramdisk else tmp_path) as base:
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
