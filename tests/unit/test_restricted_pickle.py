"""The restricted unpickler: DCP metadata loads, anything naming another global is refused
before it runs, and damaged files get named errors."""

from __future__ import annotations

import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

from resilient_ckpt import _restricted_pickle
from resilient_ckpt.errors import CorruptCheckpointError, UnsafeCheckpointError

pytestmark = pytest.mark.timeout(60)


class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.mkdir, (self.marker,))


@pytest.fixture
def metadata_file(tmp_path):
    state = {
        "w": torch.randn(3, 4),
        "nested": {"i": torch.arange(5), "bf": torch.zeros(2, dtype=torch.bfloat16)},
        "step": 7,
        "name": "x",
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    return tmp_path / "ckpt" / ".metadata"


def test_loads_torch_metadata_like_pickle(metadata_file):
    data = metadata_file.read_bytes()
    got = _restricted_pickle.loads(data, path=str(metadata_file), expect=Metadata)
    assert got.state_dict_metadata == pickle.loads(data).state_dict_metadata
    assert got.storage_data == pickle.loads(data).storage_data


def test_refuses_code_before_running_it(tmp_path):
    marker = tmp_path / "ran"
    data = pickle.dumps(_RunsCode(str(marker)))
    with pytest.raises(UnsafeCheckpointError, match=r"evil\.metadata.*posix\.mkdir") as info:
        _restricted_pickle.loads(data, path="evil.metadata")
    assert info.value.name == "posix.mkdir" and info.value.path == "evil.metadata"
    assert isinstance(info.value, pickle.UnpicklingError)
    assert not marker.exists()


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: b"", "is empty"),
        (lambda b: b[: len(b) // 2], "is truncated"),
        (lambda b: bytes(range(256)) * 4, "not a"),
        (lambda b: pickle.dumps([1, 2]), "holds a list, not a Metadata"),
    ],
)
def test_damaged_files_get_named_errors(metadata_file, damage, message):
    data = damage(metadata_file.read_bytes())
    with pytest.raises(CorruptCheckpointError, match=message) as info:
        _restricted_pickle.loads(data, path="ckpt/.metadata", expect=Metadata)
    assert info.value.path == "ckpt/.metadata"
    assert str(info.value).startswith("ckpt/.metadata: ")


def test_garbage_in_a_file_is_not_called_empty(tmp_path):
    # A buffered file: the unpickler peeks at a bad first byte without consuming it.
    path = tmp_path / ".metadata"
    path.write_bytes(b"\x13\x37" * 512)
    with open(path, "rb") as f, pytest.raises(CorruptCheckpointError, match="not a pickle"):
        _restricted_pickle.load(f, path=str(path))


def test_trusted_loads_any_global_with_the_same_named_errors(tmp_path):
    marker = tmp_path / "ran"
    data = pickle.dumps(_RunsCode(str(marker)))
    assert _restricted_pickle.loads(data, path="x", trusted=True) is None
    assert marker.exists()
    with pytest.raises(CorruptCheckpointError, match="x: is empty"):
        _restricted_pickle.loads(b"", path="x", trusted=True)
