"""The command tells the truth about damaged checkpoints (issue 47, point 3): complete means
committed and every file of its recorded size, ``ls --verify`` fails when a row fails, and
``convert`` refuses a checkpoint that fails its checksums unless told otherwise.

Every checkpoint here is a real one, written by two ranks (each its own data file), then
damaged by the test.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from resilient_ckpt.async_ckpt.state_dict_saver import (
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from resilient_ckpt.cli import main
from resilient_ckpt.testing import launch
from resilient_ckpt.testing.faults import truncate
from tests._helpers import flip_byte

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]


def _state(rank: int) -> dict:
    gen = torch.Generator().manual_seed(rank)
    return {f"rank{rank}": {"w": torch.randn(128, 64, generator=gen)}, "step": 3}


def _save_both(rank: int, world: int, ours: str, plain: str) -> None:
    """An async DCP save of ours (its commit record holds every file's size and CRC32) and
    a plain ``dcp.save`` (no checksums) of the same state."""
    queue = AsyncCallsQueue()
    writer = FileSystemWriterAsync(ours)
    plan = save_state_dict_async_plan(_state(rank), writer)
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    commit = functools.partial(save_state_dict_async_finalize, *plan)
    queue.schedule_async_request(AsyncRequest(save_fn, args, [commit], preload_fn=preload_fn))
    queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    queue.close()
    dcp.save(_state(rank), checkpoint_id=plain)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("truth")
    ours, plain = str(root / "ours" / "iter_0000010"), str(root / "plain" / "iter_0000010")
    launch(_save_both, 2, ours, plain, timeout=120)
    return {"ours": ours, "plain": plain}


@pytest.fixture()
def ckpts(pristine: dict[str, str], tmp_path) -> dict[str, str]:
    """A fresh copy of each checkpoint for the test to damage."""
    copies = {}
    for kind, path in pristine.items():
        copies[kind] = str(tmp_path / kind / os.path.basename(path))
        shutil.copytree(path, copies[kind])
    return copies


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _data_files(path: str) -> list[str]:
    return sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".distcp"))


def _ls(capsys, path: str, *extra: str) -> tuple[int, dict]:
    code, out, _ = _run(capsys, "--json", "ls", path, *extra)
    (entry,) = json.loads(out)
    return code, entry


@pytest.mark.parametrize("kind", ["ours", "plain"])
def test_ls_calls_a_checkpoint_with_a_short_or_missing_file_incomplete(capsys, ckpts, kind):
    path = ckpts[kind]
    code, entry = _ls(capsys, path)
    assert code == 0 and entry["complete"] and entry["world_size"] == 2
    first, second = _data_files(path)
    truncate(second, 100)
    code, entry = _ls(capsys, path)
    assert code == 0 and entry["complete"] is False  # ls without --verify lists, never fails
    assert entry["committed"] is True  # committed, and damaged: not a save in progress
    (problem,) = entry["problems"]
    assert os.path.basename(second) in problem and "bytes" in problem
    code, out, _ = _run(capsys, "ls", path)
    (row,) = [line for line in out.splitlines() if line.startswith("dcp")]
    assert row.split()[-2:] == ["NO", "-"]  # complete, verified
    os.unlink(first)
    _, entry = _ls(capsys, path)
    assert any(os.path.basename(first) in p and "missing" in p for p in entry["problems"])


def test_ls_verify_exits_non_zero_when_a_row_fails(capsys, ckpts) -> None:
    assert _run(capsys, "ls", "--verify", ckpts["ours"], ckpts["plain"])[0] == 0
    flip_byte(_data_files(ckpts["ours"])[0])  # same size: only the checksum sees it
    code, entry = _ls(capsys, ckpts["ours"])
    assert code == 0 and entry["complete"]
    code, out, _ = _run(capsys, "ls", "--verify", ckpts["ours"], ckpts["plain"])
    rows = {line.split()[1]: line.split() for line in out.splitlines()[1:]}
    assert code == 1 and rows[ckpts["ours"]][-1] == "FAILED" and rows[ckpts["plain"]][-1] == "ok"
    code, entry = _ls(capsys, ckpts["ours"], "--verify")
    assert code == 1 and entry["verified"] is False and "CRC32" in " ".join(entry["problems"])


def test_convert_refuses_a_checkpoint_failing_its_checksums(capsys, ckpts, tmp_path) -> None:
    victim = _data_files(ckpts["ours"])[1]
    flip_byte(victim)
    out_file = str(tmp_path / "out.pt")
    code, _, err = _run(capsys, "convert", ckpts["ours"], out_file)
    assert code == 1 and not os.path.exists(out_file)
    assert os.path.basename(victim) in err and "CRC32" in err and "--ignore-checksums" in err
    argv = ["--json", "convert", ckpts["ours"], out_file, "--ignore-checksums"]
    code, out, err = _run(capsys, *argv)
    result = json.loads(out)
    assert code == 0 and result["verified"] is False and os.path.basename(victim) in err
    assert err.startswith("resilient-ckpt convert: warning:") and "converting it anyway" in err
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = torch.load(out_file)
    assert torch.equal(state["rank0"]["w"], _state(0)["rank0"]["w"])  # the intact shard
    assert not torch.equal(state["rank1"]["w"], _state(1)["rank1"]["w"])  # the damaged one


def test_convert_refuses_a_truncated_plain_checkpoint(capsys, ckpts, tmp_path) -> None:
    out_file = str(tmp_path / "plain.pt")
    assert _run(capsys, "convert", ckpts["plain"], out_file)[0] == 0
    os.unlink(out_file)
    truncate(_data_files(ckpts["plain"])[0], 64)
    code, _, err = _run(capsys, "convert", ckpts["plain"], out_file)
    assert code == 1 and "fails verification" in err and "bytes" in err
    assert not os.path.exists(out_file)
