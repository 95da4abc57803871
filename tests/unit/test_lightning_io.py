"""ResilientCheckpointIO and LocalCheckpointCallback without a Trainer: arguments, the
background write, removal of a file still being written, and the missing-extra error."""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest
import torch

from resilient_ckpt.errors import ConfigurationError

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None, reason="needs the lightning extra"
)


def test_bad_arguments_are_rejected_with_their_names(tmp_path) -> None:
    from resilient_ckpt.integrations.lightning import (
        LocalCheckpointCallback,
        ResilientCheckpointIO,
    )

    with pytest.raises(ConfigurationError, match="every_n_train_steps"):
        LocalCheckpointCallback(tmp_path, every_n_train_steps=0)
    with pytest.raises(ConfigurationError, match="replication_factor"):
        LocalCheckpointCallback(tmp_path, replication_factor=0)
    with pytest.raises(ConfigurationError, match="LocalCheckpointCallback"):
        ResilientCheckpointIO(local=object())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="storage_options"):
        ResilientCheckpointIO().save_checkpoint({}, str(tmp_path / "x.ckpt"), {"a": 1})


def test_background_save_load_and_remove(tmp_path) -> None:
    from resilient_ckpt.integrations.lightning import ResilientCheckpointIO

    io = ResilientCheckpointIO()
    path = str(tmp_path / "sub" / "step=3.ckpt")
    weights = torch.arange(1000, dtype=torch.float32)
    try:
        io.save_checkpoint({"global_step": 3, "state_dict": {"w": weights}}, path)
        weights.zero_()  # training goes on: the snapshot was taken before the call returned
        loaded = io.load_checkpoint(path)  # waits for the write
        assert loaded["global_step"] == 3
        assert torch.equal(loaded["state_dict"]["w"], torch.arange(1000, dtype=torch.float32))
        assert io.resumed_from == {"source": "global", "step": 3, "path": path}
        other = str(tmp_path / "sub" / "step=4.ckpt")
        io.save_checkpoint({"global_step": 4, "state_dict": {"w": weights}}, other)
        io.remove_checkpoint(other)  # waits for the write in flight, then removes
        assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["step=3.ckpt"]
        with pytest.raises(FileNotFoundError, match="missing.ckpt"):
            io.load_checkpoint(str(tmp_path / "missing.ckpt"))
    finally:
        io.teardown()


def test_clear_error_without_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    monkeypatch.delitem(sys.modules, "resilient_ckpt.integrations.lightning", raising=False)
    with pytest.raises(ImportError, match=r"resilient-ckpt\[lightning\]"):
        importlib.import_module("resilient_ckpt.integrations.lightning")
