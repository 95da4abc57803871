"""``dcp.load`` through our reader on a directory without a checkpoint names the directory
and says it holds none (issue 47, point 4), instead of torch's bare "metadata is None"."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from resilient_ckpt.async_ckpt.cached_metadata_filesystem_reader import (
    CachedMetadataFileSystemReader,
)
from resilient_ckpt.errors import NoCheckpointError

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.mark.parametrize("make", [True, False], ids=["empty", "absent"])
def test_a_directory_without_a_checkpoint_is_named(tmp_path, make) -> None:
    path = tmp_path / "ckpt"
    if make:
        path.mkdir()
    reader = CachedMetadataFileSystemReader(str(path))
    with pytest.raises(NoCheckpointError, match="holds no DCP checkpoint") as caught:
        reader.read_metadata()
    assert caught.value.path == str(path) and isinstance(caught.value, FileNotFoundError)
    assert ("does not exist" in str(caught.value)) is not make
    with pytest.raises(CheckpointException, match=f"{path} holds no DCP checkpoint"):
        dcp.load({"w": torch.zeros(2)}, storage_reader=CachedMetadataFileSystemReader(str(path)))
