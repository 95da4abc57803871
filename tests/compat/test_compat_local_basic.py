"""The behaviours upstream's tests/checkpointing/unit/test_basic_local.py exercises, on two
gloo ranks on the CPU, with a state that implements only ``copy_tensors_to_cpu`` and
``restore_tensor_device`` (as upstream's test state dict).

One launch runs every case (starting ranks costs more than the cases themselves):

* save, then find_latest/load with the same manager and with a new one ("restart"), for
  synchronous and asynchronous saves (``AsyncRequest.execute_sync``, as upstream), in a
  directory that does not exist yet, on a disk directory and on ``/dev/shm``;
* one rank's file removed: no complete checkpoint (-1) on every rank;
* saving again after that, then a newer iteration: retention removes the older file;
* the same state saved through an ``AsyncCallsQueue`` (fork caller) and changed at once;
* find_latest with files of other ranks and files with an extra suffix in a rank's
  directory and replication off: nothing complete (-1).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from resilient_ckpt.async_ckpt.core import AsyncCallsQueue
from resilient_ckpt.local.ckpt_managers.local_manager import LocalCheckpointManager
from resilient_ckpt.testing import launch

from ._local_states import HostOnlyStateDict

pytestmark = pytest.mark.dist


def _save(mgr: LocalCheckpointManager, state: HostOnlyStateDict, iteration: int, is_async: bool):
    request = mgr.save(state, iteration, is_async)
    if is_async:
        state._tensors[0].add_(1.0)  # after save() returns, the state is the trainer's again
        request.execute_sync()
    else:
        assert request is None


def _state(rank: int, iteration: int) -> HostOnlyStateDict:
    return HostOnlyStateDict(iteration=iteration, seed=10 * rank + iteration)


def _save_load_scenarios(rank: int, root: Path, is_async: bool) -> None:
    ckpt_dir = root / "subdir"  # does not exist yet
    mgr = LocalCheckpointManager(ckpt_dir)
    state = _state(rank, 1)
    expected = state.clone()
    _save(mgr, state, 1, is_async)
    assert mgr.find_latest() == 1
    loaded, ckpt_id = mgr.load()
    assert loaded.same_values(expected) and ckpt_id == (1, rank, "")

    restarted = LocalCheckpointManager(ckpt_dir)
    assert restarted.find_latest() == 1
    loaded, ckpt_id = restarted.load()
    assert loaded.same_values(expected) and ckpt_id == (1, rank, "")

    # One rank's file disappears: the iteration is incomplete on every rank.
    mgr = LocalCheckpointManager(ckpt_dir)
    first = mgr._local_ckpt_path_from_id(mgr._ckpt_id(1))
    dist.barrier()
    if rank == 1:
        os.remove(first)
    dist.barrier()
    assert mgr.find_latest() == -1

    # The same manager saves again, then a newer iteration; retention drops the older.
    _save(mgr, _state(rank, 1), 1, is_async)
    assert first.exists()
    _save(mgr, _state(rank, 2), 2, is_async)
    deadline = time.monotonic() + 5
    while first.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not first.exists()
    assert mgr._local_ckpt_path_from_id(mgr._ckpt_id(2)).exists()
    dist.barrier()


def _find_latest_without_replication(rank: int, root: Path, suffix: str) -> None:
    mgr = LocalCheckpointManager(root / f"find_latest_{len(suffix)}")
    my_dir = Path(mgr.local_ckpt_dir)
    my_dir.mkdir(parents=True, exist_ok=True)
    files = [my_dir / mgr._filename_from_template(10, r, suffix) for r in range(2)]
    # rank 0: nothing; rank 1: its own file and rank 0's.
    if rank == 1:
        files[0].touch()
        files[1].touch()
    dist.barrier()
    assert mgr.find_latest() == -1
    dist.barrier()


def _through_a_queue(rank: int, root: Path) -> None:
    """The way training code schedules a local save: on an AsyncCallsQueue (fork caller)."""
    mgr = LocalCheckpointManager(root / "queued")
    queue = AsyncCallsQueue(persistent=False)
    try:
        state = _state(rank, 3)
        expected = state.clone()
        queue.schedule_async_request(mgr.save(state, 3, is_async=True))
        state._tensors[-1].mul_(-1)
        queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()
    fresh = LocalCheckpointManager(root / "queued")
    assert fresh.find_latest() == 3
    loaded, _ = fresh.load()
    assert loaded.same_values(expected)


def _scenarios(rank: int, world_size: int, disk_root: str, shm_root: str) -> None:
    for index, base in enumerate((disk_root, shm_root)):
        for is_async in (False, True):
            _save_load_scenarios(rank, Path(base) / f"case{index}{int(is_async)}", is_async)
    _through_a_queue(rank, Path(disk_root))
    for suffix in ("", "some_suffix", "some suffix with spaces"):
        _find_latest_without_replication(rank, Path(disk_root), suffix)


def test_basic_local_behaviours_on_two_ranks(tmp_path):
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    shm_root = tempfile.mkdtemp(prefix="rc_compat_local_", dir=shm)
    try:
        launch(_scenarios, 2, str(tmp_path), shm_root, timeout=150)
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)
