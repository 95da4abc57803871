"""The trust boundary of ``LocalCheckpointManager.load`` (one process, no process group).

By default the state is unpickled freely, as NVRx does: the job trusts what it wrote to its
own directories (the first test pins that this is so). ``weights_only=True`` unpickles it
with an allow-list, extended as ``torch.load(weights_only=True)``'s is: a global outside it
is refused before it runs, naming the file and the global.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from pathlib import Path

import pytest
import torch

from resilient_ckpt.errors import ConfigurationError, UnsafeCheckpointError
from resilient_ckpt.local import BasicTensorAwareStateDict, LocalCheckpointManager, _nvrx_format
from resilient_ckpt.utils import diff
from tests._helpers import RunsCode, safe_globals
from tests.compat._local_states import HostOnlyStateDict, write_like_nvrx, write_nvrx_basic

pytestmark = pytest.mark.timeout(120)


@dataclasses.dataclass
class Schedule:
    """A user's class in the state: allowed only once marked safe."""

    warmup: int
    decay: float


def _plain_state() -> dict:
    return {
        "model": {"w": torch.randn(4, 3), "b": torch.zeros(3, dtype=torch.bfloat16)},
        "optim": collections.OrderedDict(m=torch.ones(2), v=[torch.ones(1), torch.zeros(1)]),
        "args": ("adam", 0.1, None, 3 + 1j),
        "iteration": 7,
        "seen": {"a", "b"},
    }


def _save(root: Path, state: dict, iteration: int = 1) -> None:
    LocalCheckpointManager(root, "s").save(BasicTensorAwareStateDict(state), iteration)


def _load(root: Path, **kwargs) -> dict:
    mgr = LocalCheckpointManager(root, "s", **kwargs)
    assert mgr.find_latest() != -1
    return mgr.load()[0].state_dict


def test_by_default_the_job_trusts_its_own_checkpoints(tmp_path):
    marker = tmp_path / "ran"
    _save(tmp_path / "ckpt", {"w": torch.ones(2), "hook": RunsCode(str(marker))})
    _load(tmp_path / "ckpt")
    assert marker.exists()  # the documented boundary: whoever writes the files runs code


def test_weights_only_refuses_code_before_it_runs(tmp_path):
    marker = tmp_path / "ran"
    root = tmp_path / "ckpt"
    _save(root, {"w": torch.ones(2), "hook": RunsCode(str(marker))})
    with pytest.raises(UnsafeCheckpointError) as info:
        _load(root, weights_only=True)
    assert not marker.exists()
    shard = root / "s" / "0" / "iter_0000001_0_local.pt"
    assert (info.value.name, info.value.path) == ("posix.mkdir", str(shard))
    assert f"{shard}: refused to load the global posix.mkdir" in str(info.value)
    assert "weights_only=False" in str(info.value) and "add_safe_globals" in str(info.value)


def test_weights_only_loads_plain_state(tmp_path):
    state = _plain_state()
    _save(tmp_path, state)
    assert diff(state, _load(tmp_path, weights_only=True)) == ([], [], [])


def test_weights_only_allow_list_is_extended_as_torchs(tmp_path):
    state = {"w": torch.ones(3), "schedule": Schedule(10, 0.5)}
    _save(tmp_path, state)
    with pytest.raises(UnsafeCheckpointError, match=r"Schedule"):
        _load(tmp_path, weights_only=True)
    with safe_globals([Schedule]):
        loaded = _load(tmp_path, weights_only=True)
    assert loaded["schedule"] == Schedule(10, 0.5) and torch.equal(loaded["w"], state["w"])


def test_weights_only_state_saved_whole(tmp_path):
    """A state without ``pop_tensors`` is saved with torch.save: torch's weights_only loads
    it, the user's class marked safe."""
    state = HostOnlyStateDict(iteration=3, seed=1)
    expected = state.clone()
    LocalCheckpointManager(tmp_path, "s").save(state, 3)
    mgr = LocalCheckpointManager(tmp_path, "s", weights_only=True)
    assert mgr.find_latest() == 3
    with pytest.raises(UnsafeCheckpointError, match=r"HostOnlyStateDict") as info:
        mgr.load()
    assert "iter_0000003_0_local.pt" in str(info.value)
    with safe_globals([HostOnlyStateDict]):
        loaded, _ = mgr.load()
    assert loaded.same_values(expected)


@pytest.mark.skipif(
    not hasattr(torch.serialization, "safe_globals"),
    reason="torch 2.4 cannot allow a class under another name (NVRx's)",
)
def test_weights_only_reads_nvrx_files(tmp_path):
    """NVRx's BasicTensorAwareStateDict is allowed, as ours (whose load then moves the
    tensors to CUDA, as NVRx's does: so the state is checked before that step)."""
    path = tmp_path / "iter_0000005_0_local.pt"
    write_nvrx_basic(path, {"w": torch.ones(3), "step": [torch.tensor(5), "adam"]})
    state = _nvrx_format.load_state(path.read_bytes(), weights_only=True, source=str(path))
    assert type(state) is BasicTensorAwareStateDict
    assert torch.equal(state.state_dict["w"], torch.ones(3))
    assert state.state_dict["step"][1] == "adam"


def test_weights_only_refuses_code_in_nvrx_files(tmp_path):
    marker = tmp_path / "ran"
    write_like_nvrx(tmp_path / "s" / "0", 5, 0, _Evil(str(marker)))
    mgr = LocalCheckpointManager(tmp_path, "s", weights_only=True)
    assert mgr.find_latest() == 5
    with pytest.raises(UnsafeCheckpointError, match="posix.mkdir"):
        mgr.load()
    assert not marker.exists()


class _Evil:
    """What a hostile file in NVRx's layout holds."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def copy_tensors_to_cpu(self) -> None:
        pass

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.mkdir, (self.marker,))


def test_weights_only_must_be_a_bool(tmp_path):
    with pytest.raises(ConfigurationError, match="weights_only"):
        LocalCheckpointManager(tmp_path, "s", weights_only="yes")  # type: ignore[arg-type]
