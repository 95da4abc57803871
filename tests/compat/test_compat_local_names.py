"""NVRx's private and public names around local checkpoints, in one process.

Upstream's tests and Megatron-LM locate a rank's file with
``LocalCheckpointManager._filename_from_template`` / ``_local_ckpt_path_from_id`` and build
replication groups with ``replication.group_utils``; these are the names they use.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from resilient_ckpt.errors import ConfigurationError
from resilient_ckpt.local._manifest import DATA, DIRTY, file_name, parse_name
from resilient_ckpt.local.ckpt_managers.local_manager import LocalCheckpointManager
from resilient_ckpt.local.replication import group_utils
from resilient_ckpt.local.replication.torch_device_utils import TensorPlaceholder


def test_filename_from_template_names_the_files_the_manager_writes(tmp_path):
    mgr = LocalCheckpointManager(tmp_path, "job")
    assert mgr._filename_from_template(10, 3) == "iter_0000010_3_local.pt"
    assert mgr._filename_from_template(10, 3) == file_name(10, 3, DATA)
    assert mgr._filename_from_template(10, 3, ".dirty") == file_name(10, 3, DIRTY)
    assert mgr._filename_from_template(12_345_678, 0) == "iter_12345678_0_local.pt"
    assert mgr._filename_from_template("42", 1) == "iter_0000042_1_local.pt"
    # Suffixes go before ".pt", as upstream's test of unrelated files relies on.
    name = mgr._filename_from_template(10, 1, "some suffix with spaces")
    assert name == "iter_0000010_1_localsome suffix with spaces.pt"
    assert parse_name(name) is None
    # Non-digit strings pass through, so glob patterns can be built.
    assert mgr._filename_from_template("*", "*", "*") == "iter_*_*_local*.pt"
    with pytest.raises(ConfigurationError, match="iteration"):
        mgr._filename_from_template(-1, 0)


def test_local_ckpt_path_from_id(tmp_path):
    mgr = LocalCheckpointManager(tmp_path, "job")
    path = mgr._local_ckpt_path_from_id((7, 1, "job"))
    assert isinstance(path, Path)
    assert path == tmp_path / "job" / "0" / "iter_0000007_1_local.pt"
    assert mgr._local_ckpt_path_from_id((7, 1, "job"), True).name == "iter_0000007_1_local.dirty.pt"
    assert mgr._filename_to_id(path.name) == (7, 1, "job")
    with pytest.raises(ConfigurationError, match="session"):
        mgr._local_ckpt_path_from_id((7, 1, "other"))
    with pytest.raises(ConfigurationError, match="not the name"):
        mgr._filename_to_id("notes.txt")


def test_group_utils_has_upstreams_names():
    for name in (
        "ExchangePlan",
        "ExchangePlanEntry",
        "GroupWrapper",
        "ProcessGroupLike",
        "batched",
        "parse_group_sequence",
    ):
        assert hasattr(group_utils, name), name
    assert list(group_utils.batched("ABCDEFG", 3)) == [("A", "B", "C"), ("D", "E", "F"), ("G",)]
    with pytest.raises(ValueError):
        list(group_utils.batched([1], 0))


def test_parse_group_sequence_matches_upstreams_cliques():
    assert group_utils.parse_group_sequence(2, 2, 8) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert group_utils.parse_group_sequence(1, 3, 6) == [[0, 1, 2], [3, 4, 5]]
    assert group_utils.parse_group_sequence(4, 1, 4) == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="divisible"):
        group_utils.parse_group_sequence(2, 2, 6)
    with pytest.raises(ValueError, match="replication_jump"):
        group_utils.parse_group_sequence(0, 2, 4)


def test_group_wrapper_refuses_what_is_not_a_group():
    wrapper = group_utils.GroupWrapper()
    assert group_utils.GroupWrapper.wrap(wrapper) is wrapper
    with pytest.raises(ValueError, match="ProcessGroup"):
        group_utils.GroupWrapper.wrap([0, 1])


def test_tensor_placeholder_round_trip():
    import torch

    tensor = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    placeholder = TensorPlaceholder(tensor)
    assert placeholder.hollow_tensor.device.type == "meta"
    empty = placeholder.empty_like()
    assert (empty.shape, empty.dtype, empty.device.type) == ((2, 3), torch.int16, "cpu")
    assert torch.equal(placeholder.restore(tensor), tensor)
    with pytest.raises(ValueError, match="placeholder"):
        placeholder.restore(tensor.float())
