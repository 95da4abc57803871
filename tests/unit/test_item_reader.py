"""Loading DCP items from a file in memory (``read_items`` of
``async_ckpt.cached_metadata_filesystem_reader``): the tensor a ``torch.save`` archive holds
comes back exact, as a view of the archive's bytes when they are aligned, and nothing beyond
a saved tensor is unpickled by hand."""

from __future__ import annotations

import gc
import io
import os
import pickle
import warnings
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp

from resilient_ckpt.async_ckpt import cached_metadata_filesystem_reader as readers
from resilient_ckpt.async_ckpt._dcp_items import ITEM_ALIGNMENT, item_tensor, map_file
from resilient_ckpt.async_ckpt.cached_metadata_filesystem_reader import (
    CachedMetadataFileSystemReader,
)
from resilient_ckpt.async_ckpt.core import AsyncRequest
from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from resilient_ckpt.async_ckpt.state_dict_saver import (
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)

SAVED = {
    "transposed": torch.arange(12.0).view(3, 4).t(),
    "bf16": torch.randn(7).to(torch.bfloat16),
    "scalar": torch.tensor(3, dtype=torch.int64),
    "empty": torch.zeros(0, 5),
    "offset": torch.arange(10, dtype=torch.int32)[3:],
    "bool": torch.tensor([True, False, True]),
}


def _archive(tensor: torch.Tensor, lead: int = 0) -> torch.Tensor:
    """``torch.save(tensor)`` after ``lead`` bytes, as the uint8 tensor of the archive."""
    stream = io.BytesIO()
    stream.write(bytes(lead))
    torch.save(tensor, stream)
    return torch.frombuffer(bytearray(stream.getvalue()), dtype=torch.uint8)[lead:]


@pytest.mark.parametrize("name", sorted(SAVED))
def test_saved_tensor_comes_back_exact_and_aligned_records_are_views(name) -> None:
    expected = SAVED[name]
    for lead in (0, ITEM_ALIGNMENT, 3):
        item = _archive(expected, lead)
        got = item_tensor(item)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert torch.equal(got, expected)
        start, end = item.data_ptr(), item.data_ptr() + item.numel()
        inside = got.numel() == 0 or start <= got.data_ptr() < end
        aligned = (start % ITEM_ALIGNMENT) == 0
        if aligned and got.numel():
            assert inside, "an aligned record must be viewed, not copied"


def test_anything_but_a_plain_tensor_goes_through_torchs_safe_loader() -> None:
    item = _archive({"a": torch.ones(2)})  # not a tensor: torch.load(weights_only=True)
    assert torch.equal(item_tensor(item)["a"], torch.ones(2))

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > /dev/null",))

    stream = io.BytesIO()
    with zipfile.ZipFile(stream, "w") as archive:
        archive.writestr("archive/data.pkl", pickle.dumps(Evil()))
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/version", "3\n")
    evil = torch.frombuffer(bytearray(stream.getvalue()), dtype=torch.uint8)
    with pytest.raises(pickle.UnpicklingError):
        item_tensor(evil)  # refused by our unpickler and by torch's weights-only loader


def test_map_file_reads_the_bytes(tmp_path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"0123456789")
    assert bytes(map_file(str(path)).numpy()) == b"0123456789"
    (tmp_path / "empty").write_bytes(b"")
    assert map_file(str(tmp_path / "empty")).numel() == 0


def _save_ours(state, path, align: bool) -> None:
    writer = FileSystemWriterAsync(str(path), single_file_per_rank=True)
    writer.align_items = align
    plan_ret = save_state_dict_async_plan(state, writer)
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    finalize = [lambda: save_state_dict_async_finalize(*plan_ret)]
    AsyncRequest(save_fn, args, finalize, preload_fn=preload_fn).execute_sync()


@pytest.mark.parametrize("align", [False, True])
def test_dcp_load_through_our_reader_matches_torchs(tmp_path, align) -> None:
    state = {k: v.clone() for k, v in SAVED.items()} | {"meta": {"step": 7, "lr": 0.1}}
    _save_ours(state, tmp_path / "ck", align)
    offsets = [
        info.offset
        for index, info in dcp.FileSystemReader(str(tmp_path / "ck"))
        .read_metadata()
        .storage_data.items()
        if index.fqn in SAVED
    ]
    if align:
        assert offsets and all(o % ITEM_ALIGNMENT == 0 for o in offsets)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = {k: torch.zeros_like(v) for k, v in SAVED.items()} | {"meta": {"step": 0, "lr": 0.0}}
        dcp.load(ours, storage_reader=CachedMetadataFileSystemReader(str(tmp_path / "ck")))
        theirs = {k: torch.zeros_like(v) for k, v in SAVED.items()} | {
            "meta": {"step": 0, "lr": 0.0}
        }
        dcp.load(theirs, storage_reader=dcp.FileSystemReader(str(tmp_path / "ck")))
    for key, tensor in SAVED.items():
        assert torch.equal(ours[key], tensor) and torch.equal(theirs[key], tensor), key
    assert ours["meta"] == theirs["meta"] == {"step": 7, "lr": 0.1}


def test_item_past_the_end_of_the_file_is_a_named_error(tmp_path, monkeypatch) -> None:
    _save_ours({"t": torch.ones(100)}, tmp_path / "ck", align=True)
    original = readers.map_file
    monkeypatch.setattr(
        "resilient_ckpt.async_ckpt.cached_metadata_filesystem_reader.map_file",
        lambda path: original(path)[:50],
    )
    with pytest.raises(BaseException, match="after the end of the file"):
        dcp.load(
            {"t": torch.zeros(100)},
            storage_reader=CachedMetadataFileSystemReader(str(tmp_path / "ck")),
        )


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_no_mapping_outlives_the_load(tmp_path) -> None:
    """A mapping kept alive after the load (e.g. by a reference cycle waiting for the
    garbage collector) would pin the file's pages in the page cache."""
    state = {f"t{i}": torch.randn(1000) for i in range(4)}
    _save_ours(state, tmp_path / "ck", align=False)
    gc.collect()
    gc.disable()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            target = {k: torch.zeros_like(v) for k, v in state.items()}
            dcp.load(target, storage_reader=CachedMetadataFileSystemReader(str(tmp_path / "ck")))
        with open("/proc/self/maps") as maps:
            assert str(tmp_path / "ck") not in maps.read()
    finally:
        gc.enable()
    assert all(torch.equal(target[k], v) for k, v in state.items())
