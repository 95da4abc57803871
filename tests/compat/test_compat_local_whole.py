"""A state that implements only ``copy_tensors_to_cpu``/``restore_tensor_device`` (as
upstream's own test state dict) is saved whole, in one process (rank 0 of 1).

The multi-rank cases (async, replication) are in test_compat_local_basic.py and
test_compat_local_group.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from resilient_ckpt.errors import CheckpointingException, ConfigurationError, CorruptCheckpointError
from resilient_ckpt.local._manifest import MANIFEST, file_name
from resilient_ckpt.local.ckpt_managers.local_manager import LocalCheckpointManager

from ._local_states import HostOnlyStateDict, NoHostCopyStateDict, UnpicklableStateDict


def _files(mgr: LocalCheckpointManager) -> list[str]:
    if not mgr.local_ckpt_dir.exists():
        return []
    return sorted(n for n in os.listdir(mgr.local_ckpt_dir) if not n.startswith("."))


def test_saved_whole_with_manifest_and_checksum(tmp_path):
    mgr = LocalCheckpointManager(tmp_path)
    state = HostOnlyStateDict(iteration=3, seed=1)
    expected = state.clone()
    assert mgr.save(state, 3) is None
    # Brought to the host for the snapshot, then given back its devices.
    assert state.calls == ["copy_tensors_to_cpu", "restore_tensor_device"]
    assert _files(mgr) == ["iter_0000003_0_local.manifest.json", "iter_0000003_0_local.pt"]

    fresh = LocalCheckpointManager(tmp_path)
    assert fresh.find_latest() == 3
    loaded, ckpt_id = fresh.load()
    assert ckpt_id == (3, 0, "")
    assert type(loaded) is HostOnlyStateDict and loaded.same_values(expected)
    assert loaded.calls[-1] == "restore_tensor_device"  # as NVRx's load does

    # The same checksum rule as any shard: one flipped byte and the copy does not count.
    data = mgr._local_ckpt_path_from_id((3, 0, ""))
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError):
        LocalCheckpointManager(tmp_path)._read_copy(
            LocalCheckpointManager(tmp_path)._copy_info(3, 0)
        )
    assert LocalCheckpointManager(tmp_path).find_latest() == -1


def test_snapshot_is_taken_at_save_time(tmp_path):
    mgr = LocalCheckpointManager(tmp_path)
    state = HostOnlyStateDict(iteration=5, seed=2)
    expected = state.clone()
    request = mgr.save(state, 5, is_async=True)
    assert not mgr._local_ckpt_path_from_id((5, 0, "")).exists()  # nothing committed yet
    state._tensors[0].add_(1.0)  # training goes on before the write
    state.iteration = 99
    request.execute_sync()
    fresh = LocalCheckpointManager(tmp_path)
    assert fresh.find_latest() == 5
    loaded, _ = fresh.load()
    assert loaded.same_values(expected)


def test_a_state_that_cannot_reach_the_host_is_refused_by_name(tmp_path):
    mgr = LocalCheckpointManager(tmp_path)
    with pytest.raises(ConfigurationError) as info:
        mgr.save(NoHostCopyStateDict(iteration=1, seed=3), 1)
    message = str(info.value)
    assert "pop_tensors" in message and "copy_tensors_to_cpu" in message
    assert _files(mgr) == []


def test_an_unpicklable_state_is_refused_and_left_on_its_devices(tmp_path):
    mgr = LocalCheckpointManager(tmp_path)
    state = UnpicklableStateDict(iteration=1, seed=4)
    with pytest.raises(ConfigurationError, match="picklable"):
        mgr.save(state, 1)
    assert state.calls == ["copy_tensors_to_cpu", "restore_tensor_device"]
    assert [n for n in _files(mgr) if n.endswith(MANIFEST)] == []
    # The failed request does not block the next save of the same iteration.
    mgr.save(HostOnlyStateDict(iteration=1, seed=4), 1)
    assert file_name(1, 0) in _files(mgr)


def test_load_without_find_latest_is_an_error(tmp_path):
    with pytest.raises(CheckpointingException, match="find_latest"):
        LocalCheckpointManager(tmp_path).load()


@pytest.mark.gpu
def test_cuda_state_saved_whole_comes_back_on_cuda(tmp_path):
    mgr = LocalCheckpointManager(tmp_path)
    state = HostOnlyStateDict(iteration=2, seed=5, device="cuda")
    expected = state.clone()
    mgr.save(state, 2)
    assert all(t.is_cuda for t in state._tensors)  # given back its devices after the snapshot
    fresh = LocalCheckpointManager(tmp_path)
    assert fresh.find_latest() == 2
    loaded, _ = fresh.load()
    assert all(t.is_cuda for t in loaded._tensors)
    assert loaded.same_values(expected)
    torch.cuda.synchronize()
