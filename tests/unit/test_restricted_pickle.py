"""The restricted unpickler: DCP metadata loads (as every torch release from 2.4 to 2.13
writes it: ``data/dcp_metadata``, made by its ``make.py``), anything naming another global
is refused before it runs, and damaged files get named errors. Also its safe mode for user
state (``load_state``) and the named errors of torch's ``weights_only`` load."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from resilient_ckpt import _restricted_pickle
from resilient_ckpt._torch_compat import no_dist_kwargs
from resilient_ckpt.errors import CorruptCheckpointError, UnsafeCheckpointError
from tests._helpers import RunsCode, safe_globals

pytestmark = pytest.mark.timeout(60)


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
        dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"), **no_dist_kwargs(dcp.save))
    return tmp_path / "ckpt" / ".metadata"


def test_loads_torch_metadata_like_pickle(metadata_file):
    data = metadata_file.read_bytes()
    got = _restricted_pickle.loads(data, path=str(metadata_file), expect=Metadata)
    assert got.state_dict_metadata == pickle.loads(data).state_dict_metadata
    assert got.storage_data == pickle.loads(data).storage_data


def test_refuses_code_before_running_it(tmp_path):
    marker = tmp_path / "ran"
    data = pickle.dumps(RunsCode(str(marker)))
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
    data = pickle.dumps(RunsCode(str(marker)))
    assert _restricted_pickle.loads(data, path="x", trusted=True) is None
    assert marker.exists()
    with pytest.raises(CorruptCheckpointError, match="x: is empty"):
        _restricted_pickle.loads(b"", path="x", trusted=True)


FIXTURES = Path(__file__).parent / "data" / "dcp_metadata"


def _fields(obj: object) -> dict:
    """A dataclass's fields as present on the object (files of older torch releases lack
    fields added since, which the class supplies as defaults or not at all)."""
    return dict(vars(obj))


def test_fixtures_cover_the_supported_torch_releases():
    releases = {p.name for p in FIXTURES.glob("torch-*.metadata")}
    assert {"torch-2.4.1.metadata", "torch-2.13.0.metadata"} <= releases, releases
    assert len(releases) >= 4, releases


@pytest.mark.parametrize("fixture", sorted(p.name for p in FIXTURES.glob("torch-*.metadata")))
def test_reads_metadata_of_every_torch_release_as_pickle_does(fixture):
    data = (FIXTURES / fixture).read_bytes()
    got = _restricted_pickle.loads(data, path=fixture, expect=Metadata)
    want = pickle.loads(data)
    assert got.state_dict_metadata == want.state_dict_metadata
    assert got.storage_data == want.storage_data
    assert got.planner_data == want.planner_data
    assert _fields(got.storage_meta) == _fields(want.storage_meta)
    # what make.py saved: several dtypes, a channels_last tensor, nested and plain values
    meta = got.state_dict_metadata
    assert meta["bf16"].properties.dtype == torch.bfloat16
    assert isinstance(meta["conv"].properties.memory_format, torch.memory_format)
    assert meta["optim.state.exp_avg"].size == torch.Size([4, 3])
    assert isinstance(meta["name"], BytesStorageMetadata)


@dataclasses.dataclass
class _Setting:
    key: str


def test_state_mode_allows_plain_values_given_classes_and_user_globals():
    state = {"n": 3, "c": 1 + 2j, "dev": torch.device("cpu"), "b": bytearray(b"x"), "s": {1}}
    assert _restricted_pickle.load_state(io.BytesIO(pickle.dumps(state)), path="s") == state
    with pytest.raises(UnsafeCheckpointError, match=r"^s: refused to load the global .*_Setting"):
        _restricted_pickle.load_state(io.BytesIO(pickle.dumps(_Setting("a"))), path="s")
    data = pickle.dumps([_Setting("a")])
    got = _restricted_pickle.load_state(io.BytesIO(data), path="s", allowed=[_Setting])
    assert got == [_Setting("a")]
    with safe_globals([_Setting]):
        assert _restricted_pickle.load_state(io.BytesIO(data), path="s") == [_Setting("a")]
    nested = pickle.dumps(_Outer.Inner(2))  # named by its qualified name, as torch names it
    with safe_globals([_Outer.Inner]):
        assert _restricted_pickle.load_state(io.BytesIO(nested), path="s") == _Outer.Inner(2)


class _Outer:
    @dataclasses.dataclass
    class Inner:
        n: int


class _Spliced:
    """Pickles as ``pickle.loads(payload)``, as the local format splices parts pickled once."""

    def __init__(self, inner: object) -> None:
        self.payload = pickle.dumps(inner)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return pickle.loads, (self.payload,)


def test_state_mode_restricts_nested_pickles_too(tmp_path):
    plain = pickle.dumps({"a": _Spliced([1, 2])})
    assert _restricted_pickle.load_state(io.BytesIO(plain), path="p") == {"a": [1, 2]}
    marker = tmp_path / "ran"
    evil = pickle.dumps({"a": _Spliced(RunsCode(str(marker)))})
    with pytest.raises(UnsafeCheckpointError, match="posix.mkdir"):
        _restricted_pickle.load_state(io.BytesIO(evil), path="p")
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpointError):  # the format mode allows no nested pickle
        _restricted_pickle.loads(plain, path="p")


def _torch_saved(obj: object, *, legacy: bool = False) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer, _use_new_zipfile_serialization=not legacy)
    return buffer.getvalue()


class _Other:
    """A second class no one marked safe (pickled by reference, never run)."""

    def __init__(self, n: int) -> None:
        self.n = n


def test_torch_load_names_the_refused_global(tmp_path):
    marker = tmp_path / "ran"
    data = _torch_saved({"x": RunsCode(str(marker)), "t": torch.ones(2)})
    with pytest.raises(UnsafeCheckpointError) as info:
        _restricted_pickle.torch_load(data, path="f.pt")
    assert not marker.exists()
    assert info.value.name == "posix.mkdir" and info.value.path == "f.pt"
    message = str(info.value)
    assert message.startswith("f.pt: refused to load the global posix.mkdir: ")
    assert "add_safe_globals([posix.mkdir])" in message and "\n" not in message
    assert message.endswith(
        "if you trust where the file came from, load it with weights_only=False"
    )
    with pytest.raises(UnsafeCheckpointError, match=r"came from, pass --trust$"):
        _restricted_pickle.torch_load(data, path="f.pt", trust_advice="pass --trust")
    assert not marker.exists()
    data = _torch_saved({"x": _Setting("k"), "t": torch.ones(2)})
    got = _restricted_pickle.torch_load(data, path="f.pt", allowed=[_Setting])
    assert got["x"] == _Setting("k") and torch.equal(got["t"], torch.ones(2))
    with pytest.raises(UnsafeCheckpointError, match="_Setting"):  # allowed for that load only
        _restricted_pickle.torch_load(data, path="f.pt")


@pytest.mark.skipif(
    not hasattr(torch.serialization, "get_unsafe_globals_in_checkpoint"),
    reason="torch 2.4 names only the first global it refuses",
)
def test_torch_load_names_every_refused_global_of_an_archive(tmp_path):
    data = _torch_saved({"a": _Setting("k"), "b": _Other(1), "t": torch.ones(2)})
    with pytest.raises(UnsafeCheckpointError) as info:
        _restricted_pickle.torch_load(data, path="f.pt")
    setting, other = f"{__name__}._Setting", f"{__name__}._Other"
    assert info.value.name == min(setting, other)
    assert f"refused to load the globals {min(setting, other)}, {max(setting, other)}: " in str(
        info.value
    )
    with pytest.raises(UnsafeCheckpointError) as info:  # one allowed: the other is named
        _restricted_pickle.torch_load(data, path="f.pt", allowed=[_Setting])
    assert info.value.name == other and "_Setting" not in str(info.value)


@pytest.mark.parametrize("legacy", [False, True], ids=["archive", "legacy format"])
def test_torch_load_names_the_global_from_torchs_message_where_it_cannot_read_the_file(
    tmp_path, monkeypatch, legacy
):
    """torch 2.4 has no ``get_unsafe_globals_in_checkpoint``, and it reads archives only:
    torch's message names the global then."""
    if not legacy:
        monkeypatch.setattr(_restricted_pickle, "unsafe_globals_in", lambda f: None)
    marker = tmp_path / "ran"
    data = _torch_saved({"x": RunsCode(str(marker))}, legacy=legacy)
    with pytest.raises(UnsafeCheckpointError) as info:
        _restricted_pickle.torch_load(data, path="f.pt")
    assert info.value.name == "posix.mkdir" and not marker.exists()


def _cut_in_pickle(data: bytes) -> bytes:
    return data[:20]  # the legacy format's first pickle (its magic number), cut short


DAMAGED = {
    "empty": (lambda archive, legacy: b"", "is empty"),
    "garbage": (lambda archive, legacy: b"\x13\x37" * 512, "not a readable torch.save file"),
    "cut archive": (
        lambda archive, legacy: archive[: len(archive) // 2],
        "not a readable torch.save file (RuntimeError: ",
    ),
    "cut pickle": (lambda archive, legacy: _cut_in_pickle(legacy), "is truncated"),
    "a plain pickle": (lambda archive, legacy: pickle.dumps([1, 2]), "not a readable"),
}


@pytest.mark.parametrize("trusted", [False, True], ids=["safe", "trusted"])
@pytest.mark.parametrize("kind", DAMAGED)
def test_torch_load_of_a_damaged_file_is_a_named_error(kind, trusted):
    state = {"w": torch.arange(64.0), "step": 3}
    damage, what = DAMAGED[kind]
    data = damage(_torch_saved(state), _torch_saved(state, legacy=True))
    with pytest.raises(CorruptCheckpointError) as info:
        _restricted_pickle.torch_load(data, path="f.pt", trusted=trusted)
    message = str(info.value)
    assert info.value.path == "f.pt" and message.startswith(f"f.pt: {what}"), message
    assert "\n" not in message and len(message) < 300


def test_torch_load_reads_a_file_from_its_position_and_passes_kwargs_on():
    data = _torch_saved({"w": torch.arange(4.0)})
    f = io.BytesIO(b"header" + data)
    f.seek(6)
    mapped = []

    def map_location(storage, location):  # type: ignore[no-untyped-def]
        mapped.append(location)
        return storage

    got = _restricted_pickle.torch_load(f, path="f.pt", map_location=map_location)
    assert torch.equal(got["w"], torch.arange(4.0)) and mapped == ["cpu"]
    f.seek(0, io.SEEK_END)
    with pytest.raises(CorruptCheckpointError, match="^f.pt: is empty$"):  # nothing after it
        _restricted_pickle.torch_load(f, path="f.pt")


def test_torch_load_trusted_runs_the_file_as_torch_load_does(tmp_path):
    marker = tmp_path / "ran"
    data = _torch_saved({"x": RunsCode(str(marker)), "t": torch.ones(2)})
    got = _restricted_pickle.torch_load(data, path="f.pt", trusted=True)
    assert marker.exists() and got["x"] is None and torch.equal(got["t"], torch.ones(2))


class _FailingStorage(io.BytesIO):
    def read(self, *args):  # type: ignore[no-untyped-def, override]
        raise OSError(5, "Input/output error")


def test_torch_load_lets_storage_errors_through():
    """A read that fails is the storage's trouble, not a damaged file."""
    with pytest.raises(OSError, match="Input/output error") as info:
        _restricted_pickle.torch_load(_FailingStorage(_torch_saved([1])), path="f.pt")
    assert not isinstance(info.value, CorruptCheckpointError)


def test_an_msc_checkpoint_id_reads_back_as_its_path(tmp_path):
    """multi-storage-client's DCP writer records its path object as the checkpoint id: it
    reads back as the plain path, without setting up a storage client."""
    msc_pathlib = pytest.importorskip("multistorageclient.pathlib")
    from torch.distributed.checkpoint.metadata import StorageMeta

    path = msc_pathlib.MultiStoragePath(str(tmp_path / "ckpt"))
    metadata = Metadata(state_dict_metadata={}, storage_meta=StorageMeta(checkpoint_id=path))
    got = _restricted_pickle.loads(pickle.dumps(metadata), path="m", expect=Metadata)
    assert os.fspath(got.storage_meta.checkpoint_id) == str(tmp_path / "ckpt")
