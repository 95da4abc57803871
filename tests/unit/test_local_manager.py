"""LocalCheckpointManager in one process (no process group): layout, commit, retention."""

from __future__ import annotations

import os

import pytest
import torch

from resilient_ckpt.async_ckpt.core import AsyncCallsQueue
from resilient_ckpt.errors import ConfigurationError
from resilient_ckpt.local import BasicTensorAwareStateDict, LocalCheckpointManager, _deleter
from resilient_ckpt.local._manifest import CopyInfo, file_name, parse_name
from resilient_ckpt.local.ckpt_managers import _catalogue
from resilient_ckpt.utils import diff


def _state(step: int) -> dict:
    return {"w": torch.full((4, 4), float(step)), "step": step, "l": [torch.arange(step + 1)]}


def _load(root, **kwargs):
    mgr = LocalCheckpointManager(root, "s", **kwargs)
    latest = mgr.find_latest()
    return latest, (mgr.load()[0].state_dict if latest != -1 else None)


def _names(root) -> list[str]:
    names = os.listdir(os.path.join(root, "s", "0"))
    return sorted(n for n in names if not n.startswith("."))


def test_layout_commit_and_retention(tmp_path):
    root = str(tmp_path)
    mgr = LocalCheckpointManager(root, "s", keep_latest=2)
    assert mgr.find_latest() == -1
    for step in (1, 2, 3):
        mgr.save(BasicTensorAwareStateDict(_state(step)), step)
    assert _names(root) == [
        "iter_0000002_0_local.manifest.json",
        "iter_0000002_0_local.pt",
        "iter_0000003_0_local.manifest.json",
        "iter_0000003_0_local.pt",
    ]
    latest, loaded = _load(root)
    assert latest == 3 and diff(_state(3), loaded) == ([], [], [])


def test_fork_queue_async_save(tmp_path):
    root = str(tmp_path)
    mgr = LocalCheckpointManager(root, "s")
    queue = AsyncCallsQueue(persistent=False)
    state = _state(5)
    request = mgr.save(BasicTensorAwareStateDict(state), 5, is_async=True)
    queue.schedule_async_request(request)
    state["w"].add_(100)  # after scheduling: must not reach the checkpoint
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    latest, loaded = _load(root)
    assert latest == 5 and diff(_state(5), loaded) == ([], [], [])


def test_leftovers_are_removed_and_broken_copies_ignored(tmp_path):
    root = str(tmp_path)
    LocalCheckpointManager(root, "s", keep_latest=3).save(BasicTensorAwareStateDict(_state(1)), 1)
    directory = os.path.join(root, "s", "0")
    leftovers = (
        file_name(2, 0, "dirty"),
        file_name(2, 0, "manifest"),
        file_name(2, 0, "status"),
        ".iter_0000002_0_local.manifest.json.tmp-1",
        ".deleting-iter_0000000_0_local.pt",
    )
    for name in leftovers:
        open(os.path.join(directory, name), "w").close()
    latest, _ = _load(root)
    _deleter.wait_idle()
    assert latest == 1
    assert sorted(os.listdir(directory)) == [file_name(1, 0, "manifest"), file_name(1, 0)]
    with open(os.path.join(directory, file_name(1, 0, "manifest")), "w") as f:
        f.write("{not json")
    assert _load(root)[0] == -1


def test_save_refuses_older_iterations_on_disk(tmp_path):
    root = str(tmp_path)
    big = 10_000_000
    LocalCheckpointManager(root, "s").save(BasicTensorAwareStateDict(_state(big)), big)
    fresh = LocalCheckpointManager(root, "s")
    with pytest.raises(ConfigurationError, match="not newer"):
        fresh.save(BasicTensorAwareStateDict(_state(9_999_999)), 9_999_999)
    with pytest.raises(ConfigurationError, match="TensorAwareStateDict"):
        fresh.save(_state(10_000_001), 10_000_001)  # type: ignore[arg-type]
    assert _load(root)[0] == 10_000_000


@pytest.mark.parametrize("iteration", [-1, 2.0, "3", True, None])
def test_iteration_must_be_a_non_negative_int(tmp_path, iteration):
    mgr = LocalCheckpointManager(str(tmp_path), "s")
    with pytest.raises(ConfigurationError, match="iteration must be an int >= 0"):
        mgr.save(BasicTensorAwareStateDict(_state(1)), iteration)
    assert mgr.find_latest() == -1


@pytest.mark.parametrize("session", [1, "a/b", ".."])
def test_bad_arguments(tmp_path, session):
    with pytest.raises(ConfigurationError):
        LocalCheckpointManager(str(tmp_path), session)
    with pytest.raises(ConfigurationError):
        LocalCheckpointManager(str(tmp_path), keep_latest=0)


def test_names_parse_numerically():
    assert parse_name("iter_10000000_3_local.pt") == (10_000_000, 3, "data")
    assert parse_name("iter_0000042_0_local.dirty.pt") == (42, 0, "dirty")
    assert parse_name("iter_42_0_local.pt") is None
    assert parse_name("iter_0000042_0_local.pt.bak") is None


def _copy(it: int, owner: int, holder: int, repl=None) -> CopyInfo:
    return CopyInfo(it, owner, holder, 1, 0, 2, repl, f"/r{holder}/{it}_{owner}")


def test_catalogue_decisions():
    catalogue = [[_copy(5, 0, 0), _copy(5, 1, 0), _copy(6, 0, 0)], [_copy(6, 0, 1)]]
    assert _catalogue.candidate_iterations(catalogue, 2, use_replicas=True) == [5]
    assert _catalogue.candidate_iterations(catalogue, 2, use_replicas=False) == []
    repl = {"strategy": "clique", "factor": 2, "jump": 1}
    replicated = [[_copy(5, 0, 0, repl)], [_copy(5, 1, 1, repl)]]
    assert _catalogue.check_replication(replicated, 5, repl) == []
    assert "ignored" in _catalogue.check_replication(replicated, 5, None)[0]
    with pytest.raises(ConfigurationError, match="same replication"):
        _catalogue.check_replication(replicated, 5, {**repl, "jump": 2})
    with pytest.raises(ConfigurationError, match="2 ranks"):
        _catalogue.check_world_size(replicated, 4)


@pytest.mark.gpu
def test_cuda_state_round_trip(tmp_path):
    state = {"w": torch.randn(8, device="cuda"), "c": torch.arange(3)}
    mgr = LocalCheckpointManager(str(tmp_path), "s")
    mgr.save(BasicTensorAwareStateDict(state), 1)
    queue = AsyncCallsQueue(persistent=False)
    queue.schedule_async_request(mgr.save(BasicTensorAwareStateDict(state), 2, is_async=True))
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    latest, loaded = _load(str(tmp_path))
    assert latest == 2 and loaded["w"].device.type == "cuda" and loaded["c"].device.type == "cpu"
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["c"], state["c"])
