"""storage/commit.py on POSIX: one file, a batch of renames, a checkpoint's record."""

from __future__ import annotations

import os

import pytest

from resilient_ckpt.errors import StorageError
from resilient_ckpt.storage import PosixBackend
from resilient_ckpt.storage.commit import COMMIT_RECORD, RecordCommit, RenameCommit, atomic_file


def test_atomic_file_replaces_whole_or_not_at_all(tmp_path) -> None:
    path = tmp_path / "f.bin"
    with atomic_file(str(path)) as f:
        f.write(b"old")
    with pytest.raises(RuntimeError), atomic_file(str(path)) as f:
        f.write(b"new but torn")
        raise RuntimeError("crash")
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["f.bin"]  # no temporary left behind


def test_rename_commit_publishes_a_batch_and_reports_a_failed_rename(tmp_path) -> None:
    for name in ("a.dirty", "b.dirty"):
        (tmp_path / name).write_bytes(name.encode())
    pairs = [(str(tmp_path / f"{n}.dirty"), str(tmp_path / f"{n}.data")) for n in "ab"]
    RenameCommit(str(tmp_path), pairs).commit()
    assert sorted(os.listdir(tmp_path)) == ["a.data", "b.data"]
    cleaned: list[bool] = []
    missing = [(str(tmp_path / "gone.dirty"), str(tmp_path / "gone.data"))]
    with pytest.raises(StorageError, match="gone.dirty") as info:
        RenameCommit(str(tmp_path), missing).commit(on_error=lambda: cleaned.append(True))
    assert isinstance(info.value, OSError) and cleaned == [True]


def test_record_commit_uncommit_and_discard(tmp_path) -> None:
    backend = PosixBackend()
    ckpt = str(tmp_path / "iter_1")
    backend.makedirs(ckpt)
    (tmp_path / "iter_1" / "__0_0.distcp").write_bytes(b"x")
    commit = RecordCommit(backend, ckpt)
    assert commit.record_path == os.path.join(ckpt, COMMIT_RECORD)
    commit.commit(lambda f: f.write(b"md"))
    assert commit.is_committed()
    commit.uncommit()
    assert not commit.is_committed() and os.path.exists(os.path.join(ckpt, "__0_0.distcp"))
    commit.discard()
    assert not os.path.exists(ckpt)
