"""The command never runs a checkpoint's code unless told ``--trust``, and says in one line
what is wrong with a file it cannot read (exit status 2, no traceback unless ``--debug``).

The hostile files here run ``os.makedirs(marker)`` when unpickled: the marker's existence says
whether a command ran code from the checkpoint.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from resilient_ckpt.cli import checkpoints as catalog
from resilient_ckpt.cli import main
from resilient_ckpt.errors import CorruptCheckpointError, UnsafeCheckpointError

pytestmark = pytest.mark.timeout(120)

VERBS = ("ls", "inspect", "verify", "convert")


class _RunsCode:
    """Unpickles as ``os.makedirs(marker, exist_ok=True)`` (None): a stand-in for any
    command, which may run more than once."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.makedirs, (self.marker, 0o777, True))


def _state() -> dict:
    return {"w": torch.arange(12.0).reshape(3, 4), "b": torch.zeros(4, dtype=torch.float64)}


def _dcp_save(state: dict, path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the single-process notice
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _argv(verb: str, path: Path, tmp_path: Path, *extra: str) -> list[str]:
    if verb == "convert":
        return [verb, str(path), str(tmp_path / "converted"), *extra]
    if verb == "ls":
        return [verb, str(path), "--verify", *extra]
    return [verb, str(path), *extra]


# -- hostile files -----------------------------------------------------------------------


@pytest.fixture
def hostile_torch(tmp_path: Path) -> tuple[Path, Path]:
    marker = tmp_path / "ran"
    path = tmp_path / "model.pt"
    torch.save({**_state(), "extra": _RunsCode(marker)}, path)
    return path, marker


@pytest.fixture
def hostile_metadata(tmp_path: Path) -> tuple[Path, Path]:
    """A DCP checkpoint whose ``.metadata`` is real metadata carrying one more attribute,
    which runs code when unpickled."""
    marker = tmp_path / "ran"
    ckpt = _dcp_save(_state(), tmp_path / "ckpt")
    with open(ckpt / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    metadata.payload = _RunsCode(marker)
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    return ckpt, marker


@pytest.fixture
def hostile_item(tmp_path: Path) -> tuple[Path, Path]:
    """A plain DCP checkpoint with a non-tensor item that runs code when unpickled (torch's
    default load planner loads such items with ``weights_only=False``)."""
    marker = tmp_path / "ran"
    return _dcp_save({**_state(), "extra": _RunsCode(marker)}, tmp_path / "ckpt"), marker


@pytest.mark.parametrize("verb", VERBS)
def test_torch_file_runs_nothing_without_trust(verb, hostile_torch, tmp_path, capsys) -> None:
    path, marker = hostile_torch
    code, _, err = _run(capsys, *_argv(verb, path, tmp_path))
    assert not marker.exists()
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"resilient-ckpt {verb}: error: {path}: refused to load the global")
    assert "os.makedirs" in err and "--trust" in err and "add_safe_globals" in err
    code, _, err = _run(capsys, *_argv(verb, path, tmp_path, "--trust"))
    assert code == 0, err
    assert marker.exists()


@pytest.mark.parametrize("verb", VERBS)
def test_dcp_metadata_runs_nothing_without_trust(verb, hostile_metadata, tmp_path, capsys) -> None:
    ckpt, marker = hostile_metadata
    code, out, err = _run(capsys, *_argv(verb, ckpt, tmp_path))
    assert not marker.exists()
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"resilient-ckpt {verb}: error: {ckpt / '.metadata'}: refused")
    assert "os.makedirs" in err
    code, _, err = _run(capsys, *_argv(verb, ckpt, tmp_path, "--trust"))
    assert code == 0, err
    assert marker.exists()


@pytest.mark.parametrize("verb", ["ls", "verify", "convert"])  # inspect reads no item
def test_dcp_item_runs_nothing_without_trust(verb, hostile_item, tmp_path, capsys) -> None:
    ckpt, marker = hostile_item
    code, _, err = _run(capsys, *_argv(verb, ckpt, tmp_path))
    assert not marker.exists()
    assert code == 2 and err.count("\n") == 1, err
    assert f"error: {ckpt} (item 'extra'): refused to load the global os.makedirs" in err
    code, _, err = _run(capsys, *_argv(verb, ckpt, tmp_path, "--trust"))
    assert code == 0, err
    assert marker.exists()


def test_ls_lists_a_refused_checkpoint_as_corrupt(hostile_metadata, capsys) -> None:
    ckpt, marker = hostile_metadata
    code, out, _ = _run(capsys, "--json", "ls", str(ckpt))  # not --verify: .metadata only
    (entry,) = json.loads(out)
    assert code == 2 and not marker.exists()
    assert entry["corrupt"] and not entry["complete"] and "os.makedirs" in entry["problems"][0]


def test_safe_loads_keep_what_plain_state_holds(tmp_path, capsys) -> None:
    """Without --trust, a state of tensors and plain values converts both ways intact."""
    state = {**_state(), "step": 7, "name": "run", "lr": [0.1, 0.01]}
    src = tmp_path / "plain.pt"
    torch.save(state, src)
    assert main(["convert", str(src), str(tmp_path / "as_dcp")]) == 0
    assert main(["convert", str(tmp_path / "as_dcp"), str(tmp_path / "back.pt")]) == 0
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert torch.equal(back["w"], state["w"]) and back["step"] == 7
    assert back["name"] == "run" and back["lr"] == [0.1, 0.01]


def test_api_is_safe_by_default(hostile_torch, hostile_metadata) -> None:
    path, marker = hostile_torch
    with pytest.raises(UnsafeCheckpointError) as info:
        catalog.inspect(str(path))
    assert info.value.name == "os.makedirs" and info.value.path == str(path)
    ckpt, _ = hostile_metadata
    with pytest.raises(UnsafeCheckpointError):
        catalog.read_dcp_metadata(str(ckpt))
    assert not marker.exists()
    assert {t["key"] for t in catalog.inspect(str(path), trusted=True)} == {"w", "b"}
    assert marker.exists()


# -- damaged files -----------------------------------------------------------------------


def _garbage(n: int = 4096) -> bytes:
    # Not starting with a pickle's or a zip archive's first bytes.
    return b"\x13\x37" + random.Random(37).randbytes(n)


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "garbage":
        path.write_bytes(_garbage(len(data)))
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])


def _bad_dcp(tmp_path: Path, how: str) -> tuple[Path, Path]:
    ckpt = _dcp_save(_state(), tmp_path / "ckpt")
    _damage(ckpt / ".metadata", how)
    return ckpt, ckpt / ".metadata"


def _bad_torch(tmp_path: Path, how: str) -> tuple[Path, Path]:
    path = tmp_path / "model.pt"
    torch.save(_state(), path)
    _damage(path, how)
    return path, path


def _not_a_checkpoint(tmp_path: Path, how: str) -> tuple[Path, Path]:
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "readme.txt").write_text("no checkpoint here")
    return folder, folder


CASES = [
    *[(_bad_dcp, how) for how in ("garbage", "empty", "truncated")],
    *[(_bad_torch, how) for how in ("garbage", "empty", "truncated")],
    (_not_a_checkpoint, "directory"),
]
WHAT = {"empty": "is empty", "truncated": "truncated", "garbage": "not a", "directory": "not a"}


def _case_id(case: tuple) -> str:
    return f"{case[0].__name__.strip('_')}-{case[1]}"


@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_bad_file_is_one_line_and_status_2(verb, case, tmp_path, capsys) -> None:
    make, how = case
    path, culprit = make(tmp_path, how)
    code, out, err = _run(capsys, *_argv(verb, path, tmp_path))
    if make is _not_a_checkpoint and verb == "ls":  # lists what is under it: nothing
        assert code == 0 and out.endswith(f"no checkpoints under {path}\n") and err == ""
        return
    assert code == 2, err
    assert err.startswith(f"resilient-ckpt {verb}: error: {culprit}: "), err
    assert WHAT[how] in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "converted").exists()


@pytest.mark.parametrize("verb", ["inspect", "convert", "verify"])
def test_debug_shows_the_traceback(verb, tmp_path, capsys) -> None:
    path, culprit = _bad_dcp(tmp_path, "truncated")
    code, _, err = _run(capsys, "--debug", *_argv(verb, path, tmp_path))
    assert code == 2 and "Traceback (most recent call last)" in err
    assert err.rstrip("\n").splitlines()[-1].startswith(f"resilient-ckpt {verb}: error: {culprit}")
    code, _, err = _run(capsys, *_argv(verb, path, tmp_path, "--debug"))  # after the verb too
    assert code == 2 and "Traceback" in err


@pytest.mark.parametrize("how", ["garbage", "empty", "truncated"])
def test_ls_marks_an_unreadable_checkpoint_corrupt(how, tmp_path, capsys) -> None:
    (tmp_path / "dcp").mkdir()
    ckpt, metadata = _bad_dcp(tmp_path / "dcp", how)
    torch_file, _ = _bad_torch(tmp_path, how)
    good = _dcp_save(_state(), tmp_path / "good")
    code, out, err = _run(capsys, "--json", "ls", str(tmp_path))
    by_path = {e["path"]: e for e in json.loads(out)}
    assert code == 2 and err.count("\n") == 2  # one line per unreadable checkpoint
    for path, culprit in ((ckpt, metadata), (torch_file, torch_file)):
        entry = by_path[str(path)]
        assert entry["corrupt"] and not entry["complete"], entry
        assert entry["problems"] == [entry["error"]] and entry["error"].startswith(f"{culprit}: ")
    assert by_path[str(good)]["complete"] and not by_path[str(good)]["corrupt"]
    code, out, _ = _run(capsys, "ls", str(tmp_path))
    rows = {line.split()[1]: line for line in out.splitlines()[1:]}
    assert "CORRUPT" in rows[str(ckpt)] and "CORRUPT" in rows[str(torch_file)]
    assert "CORRUPT" not in rows[str(good)] and code == 2


def test_api_names_the_file(tmp_path) -> None:
    ckpt, metadata = _bad_dcp(tmp_path, "garbage")
    with pytest.raises(CorruptCheckpointError) as info:
        catalog.inspect(str(ckpt))
    assert info.value.path == str(metadata)
    (report,) = catalog.verify_all(str(ckpt))
    assert report.corrupt and not report.ok and report.error.startswith(f"{metadata}: ")


def test_memory_tier_record_is_read_safely(tmp_path, capsys) -> None:
    """A memory tier (``<rank>/step_<N>/``) whose only commit record runs code."""
    marker = tmp_path / "ran"
    step = tmp_path / "memory" / "0" / "step_000000001"
    # Our writer records the file table that makes a memory-tier step complete.
    dcp.save(_state(), storage_writer=FileSystemWriterAsync(str(step)), no_dist=True)
    with open(step / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    metadata.payload = _RunsCode(marker)
    with open(step / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    code, out, err = _run(capsys, "--json", "ls", str(tmp_path / "memory"))
    (entry,) = json.loads(out)
    assert code == 2 and entry["kind"] == "memory" and entry["corrupt"] and not marker.exists()
    assert err.startswith(f"resilient-ckpt ls: error: {step / '.metadata'}: refused")
    code, _, err = _run(capsys, "inspect", str(tmp_path / "memory"))
    assert code == 2 and "os.makedirs" in err and not marker.exists()
    code, _, _ = _run(capsys, "inspect", str(tmp_path / "memory"), "--trust")
    assert code == 0 and marker.exists()


@pytest.mark.parametrize("verb", ("inspect", "convert"))
def test_local_shard_runs_nothing_without_trust(verb, tmp_path, capsys) -> None:
    """A local checkpoint's state is read in the managers' safe mode: a shard whose header
    names another global is refused with its name; --trust reads it in full."""
    from resilient_ckpt.local import BasicTensorAwareStateDict, LocalCheckpointManager

    marker = tmp_path / "ran"
    state = {**_state(), "extra": _RunsCode(marker)}
    LocalCheckpointManager(str(tmp_path / "root"), "s").save(BasicTensorAwareStateDict(state), 1)
    session = tmp_path / "root" / "s"
    code, _, err = _run(capsys, *_argv(verb, session, tmp_path))
    assert not marker.exists()
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "refused to load the global" in err and "os.makedirs" in err
    code, _, err = _run(capsys, *_argv(verb, session, tmp_path, "--trust"))
    assert code == 0, err
    assert marker.exists()
