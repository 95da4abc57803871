"""In-process DCP saves and loads on object stores (no process group): writer, readers,
commit record, metadata cache, overwrite."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from resilient_ckpt.async_ckpt.cached_metadata_filesystem_reader import (
    CachedMetadataFileSystemReader,
)
from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from resilient_ckpt.async_ckpt.verify import verify_checkpoint
from resilient_ckpt.errors import CheckpointExistsError

pytestmark = [pytest.mark.objstore, pytest.mark.timeout(90)]


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 32, generator=g),
        "b": torch.randn(32, generator=g).to(torch.bfloat16),
        "step": seed,
        "nested": {"ids": torch.arange(10, dtype=torch.int64) * seed},
    }


def _zeros(state: dict) -> dict:
    return {
        "w": torch.zeros_like(state["w"]),
        "b": torch.zeros_like(state["b"]),
        "step": -1,
        "nested": {"ids": torch.zeros_like(state["nested"]["ids"])},
    }


def _assert_equal(expected: dict, actual: dict) -> None:
    assert torch.equal(expected["w"], actual["w"])
    assert torch.equal(expected["b"], actual["b"])
    assert expected["step"] == actual["step"]
    assert torch.equal(expected["nested"]["ids"], actual["nested"]["ids"])


def test_dcp_roundtrip_and_metadata_cache(msc_store) -> None:
    import multistorageclient as msc

    url = msc_store.url("iteration-0001")
    state = _state(1)
    dcp.save(state, storage_writer=FileSystemWriterAsync(url, thread_count=2, use_msc=True))
    keys = msc_store.keys("iteration-0001")
    assert "iteration-0001/.metadata" in keys
    assert all(k.endswith((".distcp", ".metadata")) for k in keys), keys  # no results file
    assert verify_checkpoint(url).checksummed

    CachedMetadataFileSystemReader.clear_metadata_cache()
    for reader in (
        CachedMetadataFileSystemReader(url),
        msc.torch.MultiStorageFileSystemReader(url, thread_count=2),
    ):
        loaded = _zeros(state)
        dcp.load(loaded, storage_reader=reader)
        _assert_equal(state, loaded)

    # Overwrite: the cached metadata of the old checkpoint must not be served.
    cached = CachedMetadataFileSystemReader(url).read_metadata()
    assert CachedMetadataFileSystemReader(url).read_metadata().state_dict_metadata.keys() == (
        cached.state_dict_metadata.keys()
    )
    new_state = _state(2)
    new_state["extra"] = torch.ones(3)
    dcp.save(new_state, storage_writer=FileSystemWriterAsync(url, use_msc=True))
    loaded = {**_zeros(new_state), "extra": torch.zeros(3)}
    dcp.load(loaded, storage_reader=CachedMetadataFileSystemReader(url))
    _assert_equal(new_state, loaded)
    assert torch.equal(loaded["extra"], torch.ones(3))

    with pytest.raises(CheckpointException, match=CheckpointExistsError.__name__):
        dcp.save(state, storage_writer=FileSystemWriterAsync(url, overwrite=False))


def test_posix_reader_unchanged_by_object_store_support(tmp_path) -> None:
    """The POSIX path still reads with torch's file system and caches by inode."""
    path = str(tmp_path / "ckpt")
    state = _state(3)
    dcp.save(state, storage_writer=FileSystemWriterAsync(path))
    reader = CachedMetadataFileSystemReader(path)
    assert type(reader.fs).__name__ == "FileSystem"
    loaded = _zeros(state)
    dcp.load(loaded, storage_reader=reader)
    _assert_equal(state, loaded)
