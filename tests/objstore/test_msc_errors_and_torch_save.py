"""Bad MSC set-ups fail at once with a named error that says what to set; ``torch.save``
in the background to ``msc://`` works (the persistent worker uploads)."""

from __future__ import annotations

import pytest
import torch

from resilient_ckpt.async_ckpt.cached_metadata_filesystem_reader import (
    CachedMetadataFileSystemReader,
)
from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from resilient_ckpt.async_ckpt.torch_ckpt import TorchAsyncCheckpoint
from resilient_ckpt.errors import ConfigurationError
from resilient_ckpt.storage import get_backend

pytestmark = [pytest.mark.objstore, pytest.mark.timeout(120)]


def _all_entry_points(url: str, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        FileSystemWriterAsync(url, use_msc=True)
    with pytest.raises(ConfigurationError, match=match):
        CachedMetadataFileSystemReader(url)
    with pytest.raises(ConfigurationError, match=match):
        get_backend(url).list(url)
    ckpt = TorchAsyncCheckpoint()  # its worker starts with the first request: never here
    try:
        with pytest.raises(ConfigurationError, match=match):
            ckpt.async_save({"x": torch.ones(1)}, url)
    finally:
        ckpt.close()


def test_use_msc_takes_an_msc_url_or_a_local_path(tmp_path) -> None:
    # A plain path goes to MSC's POSIX provider, as NVRx does (tests/compat covers the save).
    assert FileSystemWriterAsync(str(tmp_path / "ckpt"), use_msc=True).use_msc
    with pytest.raises(ConfigurationError, match=r"msc://<profile>/<path> URL or a local path"):
        FileSystemWriterAsync("s3://bucket/ckpt", use_msc=True)
    with pytest.raises(ConfigurationError, match="names no profile"):
        FileSystemWriterAsync("msc:///ckpt", use_msc=True)


def test_unknown_profile(msc_store) -> None:
    _all_entry_points(
        "msc://no-such-profile/ckpt",
        rf"unknown MSC profile 'no-such-profile'.*{msc_store.profile}.*Add a profile",
    )


def test_missing_config(monkeypatch, tmp_path) -> None:
    pytest.importorskip("multistorageclient")
    monkeypatch.delenv("MSC_CONFIG", raising=False)
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.msc_config.yaml, no rclone config
    monkeypatch.setenv("XDG_CONFIG_DIRS", str(tmp_path / "xdg"))
    _all_entry_points("msc://my-profile/ckpt", "no multi-storage-client config found.*MSC_CONFIG")
    monkeypatch.setenv("MSC_CONFIG", str(tmp_path / "nowhere.yaml"))
    _all_entry_points("msc://my-profile/ckpt", r"MSC_CONFIG=.*nowhere.yaml' does not exist")


def test_torch_async_checkpoint_to_msc(msc_store) -> None:
    state = {"w": torch.randn(128, 64), "meta": {"step": 7}}
    url = msc_store.url("torch", "model.pt")
    ckpt = TorchAsyncCheckpoint()
    try:
        ckpt.async_save(state, url)
        ckpt.finalize_async_save(blocking=True)
        state["w"] += 1  # the saved snapshot was taken before async_save returned
        backend = get_backend(url)
        with backend.open_read(url) as f:
            loaded = torch.load(f, weights_only=True)
        assert torch.equal(loaded["w"] + 1, state["w"]) and loaded["meta"] == {"step": 7}
        assert msc_store.keys("torch") == ["torch/model.pt"]
    finally:
        ckpt.close()
