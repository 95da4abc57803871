"""Temporary files of interrupted writes (issue 47, point 2): named after their writer, so
that only ours whose writer is gone are ever removed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from resilient_ckpt.async_ckpt.torch_ckpt import TorchAsyncCheckpoint
from resilient_ckpt.storage.commit import (
    _host_tag,
    atomic_file,
    parse_temp_name,
    remove_stale_temp_files,
    stale_temp_files,
    temp_name,
)
from resilient_ckpt.storage.retention import latest_checkpoint

pytestmark = pytest.mark.timeout(120)


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(done.stdout)


def _touch(path: str, data: bytes = b"partial") -> str:
    with open(path, "wb") as f:
        f.write(data)
    return path


def test_a_temporary_name_says_its_writer(tmp_path) -> None:
    name = os.path.basename(temp_name(str(tmp_path / "step_25.pt")))
    parsed = parse_temp_name(name)
    assert parsed is not None and parsed.final == "step_25.pt"
    assert parsed.pid == os.getpid() and parsed.host == _host_tag()
    assert not parsed.writer_gone()  # this process
    old = parse_temp_name(".step_25.pt.tmp-4242")  # named before the host was recorded
    assert old is not None and old.host is None and not old.writer_gone()
    for other in ("step_25.pt", ".step_25.pt.tmp", ".step_25.pt.tmp-abc", "x.tmp-1@h"):
        assert parse_temp_name(other) is None, other


def test_only_ours_of_a_gone_writer_on_this_host_are_removed(tmp_path) -> None:
    host, dead = _host_tag(), _dead_pid()
    gone = _touch(str(tmp_path / f".step_1.pt.tmp-{dead}@{host}"))
    live = _touch(str(tmp_path / f".step_2.pt.tmp-{os.getpid()}@{host}"))
    elsewhere = _touch(str(tmp_path / f".step_3.pt.tmp-{dead}@{host}-other"))
    unknown_host = _touch(str(tmp_path / f".step_4.pt.tmp-{dead}"))
    foreign = _touch(str(tmp_path / f".step_5.pt.swp-{dead}@{host}"))
    complete = _touch(str(tmp_path / "step_0.pt"))
    assert stale_temp_files(str(tmp_path)) == [gone]
    assert remove_stale_temp_files(str(tmp_path)) == [gone]
    assert sorted(os.listdir(tmp_path)) == sorted(
        os.path.basename(p) for p in (live, elsewhere, unknown_host, foreign, complete)
    )


def test_atomic_file_writes_under_the_writer_name(tmp_path) -> None:
    target = str(tmp_path / "a.pt")
    with atomic_file(target) as f:
        (name,) = [n for n in os.listdir(tmp_path) if n != "a.pt"]
        parsed = parse_temp_name(name)
        assert parsed is not None and parsed.final == "a.pt" and parsed.pid == os.getpid()
        f.write(b"x")
    assert os.listdir(tmp_path) == ["a.pt"]


@pytest.mark.parametrize("persistent", [True, False], ids=["worker", "fork"])
def test_a_save_removes_the_leftovers_of_a_killed_writer(tmp_path, persistent) -> None:
    host = _host_tag()
    gone = _touch(str(tmp_path / f".step_10.pt.tmp-{_dead_pid()}@{host}"))
    live = _touch(str(tmp_path / f".step_20.pt.tmp-{os.getpid()}@{host}"))
    ckpt = TorchAsyncCheckpoint(persistent_queue=persistent)
    try:
        ckpt.async_save({"w": torch.ones(3)}, str(tmp_path / "step_30.pt"))
        ckpt.finalize_async_save(blocking=True)
    finally:
        ckpt.close()
    assert not os.path.exists(gone) and os.path.exists(live)
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "step_30.pt")


def test_latest_checkpoint_skips_what_is_not_committed(tmp_path) -> None:
    assert latest_checkpoint(str(tmp_path)) is None
    for step in (5, 10):
        _touch(str(tmp_path / f"step_{step}.pt"))
    _touch(str(tmp_path / f".step_15.pt.tmp-{os.getpid()}@{_host_tag()}"))
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "step_10.pt")
    (tmp_path / "iter_0000012").mkdir()  # a DCP save that never committed
    _touch(str(tmp_path / "iter_0000012" / "__0_0.distcp"))
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "step_10.pt")
    _touch(str(tmp_path / "iter_0000012" / ".metadata"))
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "iter_0000012")


def test_terminate_twice_is_harmless_and_a_later_save_restarts(tmp_path, caplog) -> None:
    ckpt = TorchAsyncCheckpoint(persistent_queue=False)
    ckpt.async_save({"w": torch.ones(2)}, str(tmp_path / "a.pt"))
    assert len(ckpt.finalize_async_save(blocking=True, terminate=True)) == 1
    assert ckpt.finalize_async_save(blocking=True, terminate=True) == []
    assert ckpt.finalize_async_save() == []
    with caplog.at_level("INFO", logger="resilient_ckpt.async_ckpt.torch_ckpt"):
        ckpt.async_save({"w": torch.zeros(2)}, str(tmp_path / "b.pt"))
    assert "starting a new background worker" in caplog.text
    assert len(ckpt.finalize_async_save(blocking=True, terminate=True)) == 1
    assert torch.equal(torch.load(tmp_path / "b.pt")["w"], torch.zeros(2))
