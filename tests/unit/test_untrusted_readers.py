"""Every library reader of a ``.metadata`` or commit record, given a file from elsewhere:
a pickle built to run code is refused before it runs (the marker it would create never
exists), and an empty, truncated, garbage or wrong-kind file is a one-line named error
naming the file. The tiered restore treats such a record as unavailable and logs why."""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from resilient_ckpt._torch_compat import no_dist_kwargs
from resilient_ckpt.async_ckpt.cached_metadata_filesystem_reader import (
    CachedMetadataFileSystemReader,
    WeightsOnlyLoadPlanner,
    clear_metadata_cache,
)
from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from resilient_ckpt.async_ckpt.verify import verify_checkpoint
from resilient_ckpt.errors import CorruptCheckpointError, UnsafeCheckpointError
from resilient_ckpt.tiered import _restore
from resilient_ckpt.tiered._layout import scan_memory, step_name
from resilient_ckpt.tiered._verifying_reader import VerifyingReader
from tests._helpers import RunsCode, safe_globals

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::UserWarning")]


@dataclasses.dataclass
class Point:
    """A user's class: not allowed unless the user marks it safe."""

    x: int
    y: int


def _save(state: dict, path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path), **no_dist_kwargs(dcp.save))


@pytest.fixture(scope="module")
def good_metadata(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("good") / "ckpt"
    _save({"w": torch.ones(3), "step": 3}, path)
    return (path / ".metadata").read_bytes()


def _malicious(good: bytes, marker: str) -> bytes:
    """Real metadata with a code-running object tucked inside it."""
    metadata = pickle.loads(good)
    metadata.planner_data = {"innocent": RunsCode(marker)}
    return pickle.dumps(metadata)


def _damaged(kind: str, good: bytes) -> tuple[bytes, str]:
    return {
        "empty": (b"", "is empty"),
        "truncated": (good[: len(good) // 2], "is truncated"),
        "garbage": (bytes(range(256)) * 4, "not a"),
        "wrong kind": (pickle.dumps({"a": [1, 2]}), "holds a dict, not a Metadata"),
    }[kind]


# Each reader, given a checkpoint directory whose commit record it reads; returns the path
# of the record it names in errors.
def _cached(d: str) -> None:
    CachedMetadataFileSystemReader(d).read_metadata()


def _uncached(d: str) -> None:
    CachedMetadataFileSystemReader(d, cache_metadata=False).read_metadata()


def _writer(d: str) -> None:
    FileSystemWriterAsync(d).read_metadata()


def _verify(d: str) -> None:
    verify_checkpoint(d)


def _durable(d: str) -> None:
    # d is <durable>/step_000000001
    _restore.durable_reader(os.path.dirname(d), 1)


def _record(d: str) -> None:
    path = os.path.join(d, ".metadata")
    with open(path, "rb") as f:
        _restore.record_table(f.read(), path)


def _verifying_reader(d: str) -> None:
    with open(os.path.join(d, ".metadata"), "rb") as f:
        data = f.read()
    VerifyingReader(d, data, {}, {}, metadata_name=os.path.join(d, ".metadata")).read_metadata()


READERS = {
    "cached": _cached,
    "uncached": _uncached,
    "writer": _writer,
    "verify": _verify,
    "tiered durable": _durable,
    "tiered record": _record,
    "tiered reader": _verifying_reader,
}


def _checkpoint_dir(tmp_path, record: bytes) -> str:
    d = tmp_path / "durable" / step_name(1)
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(record)
    return str(d)


@pytest.mark.parametrize("reader", READERS)
def test_code_in_metadata_is_refused_before_it_runs(tmp_path, good_metadata, reader):
    clear_metadata_cache()
    marker = tmp_path / "ran"
    d = _checkpoint_dir(tmp_path, _malicious(good_metadata, str(marker)))
    with pytest.raises(UnsafeCheckpointError) as info:
        READERS[reader](d)
    assert not marker.exists()
    assert info.value.name == "posix.mkdir"
    message = str(info.value)
    assert os.path.join(d, ".metadata") in message and "posix.mkdir" in message
    assert "\n" not in message and "add_safe_globals" in message


@pytest.mark.parametrize("kind", ["empty", "truncated", "garbage", "wrong kind"])
@pytest.mark.parametrize("reader", READERS)
def test_damaged_metadata_is_a_named_one_line_error(tmp_path, good_metadata, reader, kind):
    clear_metadata_cache()
    data, what = _damaged(kind, good_metadata)
    d = _checkpoint_dir(tmp_path, data)
    with pytest.raises(CorruptCheckpointError, match=what) as info:
        READERS[reader](d)
    record = os.path.join(d, ".metadata")
    assert str(info.value).startswith(f"{record}: ") and "\n" not in str(info.value)
    assert info.value.path == record


@pytest.mark.parametrize("reader", READERS)
def test_good_metadata_still_reads(tmp_path, good_metadata, reader):
    clear_metadata_cache()
    d = _checkpoint_dir(tmp_path, good_metadata)
    if reader in ("verify", "tiered durable"):
        pytest.skip("needs the data files and a file table: covered by their own tests")
    READERS[reader](d)


def test_user_marked_globals_extend_the_metadata_allow_list(tmp_path, good_metadata):
    metadata = pickle.loads(good_metadata)
    metadata.planner_data = {"origin": Point(1, 2)}
    d = _checkpoint_dir(tmp_path, pickle.dumps(metadata))
    clear_metadata_cache()
    with pytest.raises(UnsafeCheckpointError, match=r"Point"):
        _uncached(d)
    with safe_globals([Point]):
        loaded = CachedMetadataFileSystemReader(d, cache_metadata=False).read_metadata()
    assert loaded.planner_data == {"origin": Point(1, 2)}


def test_a_trusted_commit_record_reads_in_full(tmp_path, good_metadata):
    """The command line's --trust: every global allowed, the same named damage errors."""
    marker = tmp_path / "ran"
    metadata = pickle.loads(good_metadata)
    metadata.planner_data = {"innocent": RunsCode(str(marker))}
    metadata.resilient_ckpt_files = {"algorithm": "crc32", "files": {"__0_0.distcp": (8, 5)}}
    record = pickle.dumps(metadata)
    with pytest.raises(UnsafeCheckpointError):
        _restore.record_table(record, "r")
    assert not marker.exists()
    assert _restore.record_table(record, "r", trusted=True) == {"__0_0.distcp": (8, 5)}
    assert marker.exists()
    with pytest.raises(CorruptCheckpointError, match="^r: is empty$"):
        _restore.record_table(b"", "r", trusted=True)


def test_tiered_restore_treats_bad_records_as_unavailable(tmp_path, good_metadata, caplog):
    marker = tmp_path / "ran"
    memory = tmp_path / "mem"
    for owner, record in ((0, _malicious(good_metadata, str(marker))), (1, b"")):
        step = memory / str(owner) / step_name(1)
        step.mkdir(parents=True)
        (step / ".metadata").write_bytes(record)
    listings = scan_memory(str(memory))
    with caplog.at_level(logging.WARNING, logger="resilient_ckpt.tiered._restore"):
        view = _restore.local_view(str(memory), str(tmp_path / "durable"), False)
        assert _restore.read_commit_record(listings, 1) is None
    assert view.tables == {} and not marker.exists()
    refused = os.path.join(str(memory), "0", step_name(1), ".metadata")
    empty = os.path.join(str(memory), "1", step_name(1), ".metadata")
    warnings_text = "\n".join(r.getMessage() for r in caplog.records)
    assert f"refused commit record {refused}: it names the global posix.mkdir" in warnings_text
    assert f"{empty}: is empty" in warnings_text


def test_weights_only_planner_refuses_code_in_values(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "ckpt"
    _save({"w": torch.ones(3), "extra": {"hook": RunsCode(str(marker))}, "n": 4}, path)
    target = {"w": torch.zeros(3), "extra": {"hook": None}, "n": 0}
    with pytest.raises(CheckpointException) as info:
        dcp.load(
            target,
            storage_reader=CachedMetadataFileSystemReader(str(path)),
            planner=WeightsOnlyLoadPlanner(checkpoint=str(path)),
            **no_dist_kwargs(dcp.load),
        )
    assert not marker.exists()
    refused = _find(info.value, UnsafeCheckpointError)
    assert refused is not None, info.value
    assert refused.name == "posix.mkdir"
    assert f"{path}: value 'extra.hook'" in str(refused)
    assert "add_safe_globals" in str(refused) and "DefaultLoadPlanner" in str(refused)


def test_weights_only_planner_names_a_damaged_value(tmp_path):
    """A value's bytes that are no torch.save file: a named error, not torch's."""
    path = tmp_path / "ckpt"
    _save({"w": torch.ones(3), "n": 4}, path)
    where = pickle.loads((path / ".metadata").read_bytes()).storage_data
    (info,) = [v for k, v in where.items() if k.fqn == "n"]
    data = path / info.relative_path
    raw = bytearray(data.read_bytes())
    raw[info.offset : info.offset + info.length] = b"\x13" * info.length
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointException) as caught:
        dcp.load(
            {"w": torch.zeros(3), "n": 0},
            storage_reader=CachedMetadataFileSystemReader(str(path)),
            planner=WeightsOnlyLoadPlanner(checkpoint=str(path)),
            **no_dist_kwargs(dcp.load),
        )
    damaged = _find(caught.value, CorruptCheckpointError)
    assert damaged is not None, caught.value
    assert str(damaged).startswith(f"{path}: value 'n': not a readable torch.save file")


def test_weights_only_planner_loads_plain_and_allowed_values(tmp_path):
    path = tmp_path / "ckpt"
    state = {"w": torch.arange(4.0), "cfg": {"lr": 0.5, "names": ["a", "b"]}, "at": Point(3, 4)}
    _save(state, path)
    target = {"w": torch.zeros(4), "cfg": {"lr": 0.0, "names": []}, "at": None}
    with safe_globals([Point]):
        dcp.load(
            target,
            storage_reader=CachedMetadataFileSystemReader(str(path)),
            planner=WeightsOnlyLoadPlanner(),
            **no_dist_kwargs(dcp.load),
        )
    assert torch.equal(target["w"], state["w"])
    assert target["cfg"] == state["cfg"] and target["at"] == Point(3, 4)


def test_metadata_of_our_writer_reads_restricted(tmp_path):
    path = tmp_path / "ours"
    state = {"w": torch.ones(4, dtype=torch.bfloat16), "step": 9}
    dcp.save(state, storage_writer=FileSystemWriterAsync(str(path)), **no_dist_kwargs(dcp.save))
    clear_metadata_cache()
    metadata = CachedMetadataFileSystemReader(str(path)).read_metadata()
    assert isinstance(metadata, Metadata)
    assert (
        metadata.state_dict_metadata
        == pickle.loads((path / ".metadata").read_bytes()).state_dict_metadata
    )
    assert verify_checkpoint(str(path)).checksummed


def _find(exc: BaseException | None, cls: type) -> BaseException | None:
    """``exc`` or the first exception of type ``cls`` among its causes and torch failures."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, cls):
            return exc
        for failure in getattr(exc, "failures", {}).values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, cls):
                return inner
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None
