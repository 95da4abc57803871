"""One conformance suite for every storage backend: POSIX, and MSC over S3 and over POSIX."""

from __future__ import annotations

import os

import pytest

from resilient_ckpt.config import ObjectStoreOptions
from resilient_ckpt.storage import PosixBackend, StorageBackend, get_backend
from resilient_ckpt.storage.commit import RecordCommit, is_committed_listing
from resilient_ckpt.storage.msc import MscBackend

pytestmark = [pytest.mark.objstore, pytest.mark.timeout(60)]


def _write(backend: StorageBackend, path: str, data: bytes) -> None:
    with backend.open_write(path) as f:
        f.write(data[: len(data) // 2])
        f.write(memoryview(data)[len(data) // 2 :])


def _read(backend: StorageBackend, path: str) -> bytes:
    with backend.open_read(path) as f:
        return f.read()


def check_conformance(backend: StorageBackend, root: str) -> None:
    ckpt = backend.join(root, "iter_1")
    backend.makedirs(backend.join(ckpt, "sub"))
    payload = os.urandom(3000)
    _write(backend, backend.join(ckpt, "a.bin"), payload)
    _write(backend, backend.join(ckpt, "sub", "b.bin"), b"b" * 10)
    assert _read(backend, backend.join(ckpt, "a.bin")) == payload
    assert backend.exists(backend.join(ckpt, "a.bin"))
    assert backend.size(backend.join(ckpt, "a.bin")) == 3000
    assert backend.is_dir(ckpt) and not backend.is_dir(backend.join(ckpt, "a.bin"))
    listing = backend.scan(ckpt)
    assert listing.dirs == ["sub"] and listing.files == {"a.bin": 3000}
    assert backend.list(ckpt) == ["a.bin", "sub"]
    assert backend.list(root) == ["iter_1"]
    assert list(backend.walk_files(root)) == [
        backend.join(ckpt, "a.bin"),
        backend.join(ckpt, "sub", "b.bin"),
    ]

    # All or nothing: a write whose block raises leaves no object behind.
    with pytest.raises(RuntimeError, match="boom"):
        with backend.open_write(backend.join(ckpt, "torn.bin")) as f:
            f.write(b"partial")
            raise RuntimeError("boom")
    assert not backend.exists(backend.join(ckpt, "torn.bin"))

    # Overwrite replaces the whole object.
    _write(backend, backend.join(ckpt, "a.bin"), b"new")
    assert _read(backend, backend.join(ckpt, "a.bin")) == b"new"

    missing = backend.join(ckpt, "missing.bin")
    assert not backend.exists(missing) and not backend.is_dir(missing)
    assert backend.scan(missing).files == {} and backend.list(missing) == []
    with pytest.raises(FileNotFoundError):
        with backend.open_read(missing):
            pass
    backend.delete(missing)  # absent is fine

    backend.delete(backend.join(ckpt, "a.bin"))
    assert not backend.exists(backend.join(ckpt, "a.bin"))
    backend.delete(ckpt, recursive=True)
    assert not backend.exists(ckpt) and backend.list(root) == []


def test_posix_backend_conformance(tmp_path) -> None:
    check_conformance(PosixBackend(), str(tmp_path))


def test_msc_backend_conformance(msc_store) -> None:
    backend = get_backend(msc_store.url())
    assert isinstance(backend, MscBackend)
    check_conformance(backend, msc_store.url())


def test_msc_large_objects_spill_to_a_file(msc_store, tmp_path) -> None:
    """Past the memory limit, uploads and downloads go through a temporary file."""
    spool = tmp_path / "spool"
    spool.mkdir()
    backend = MscBackend(options=ObjectStoreOptions(spool_bytes=1024, spool_dir=str(spool)))
    payload = os.urandom(200_000)
    path = msc_store.url("big.bin")
    _write(backend, path, payload)
    assert _read(backend, path) == payload
    assert msc_store.keys() == ["big.bin"]
    assert os.listdir(spool) == []  # nothing left behind


def check_record_commit(backend: StorageBackend, root: str) -> None:
    """The commit object on this backend: the record is written last and whole, uncommit
    hides the checkpoint, discard removes it record first."""
    ckpt = backend.join(root, "iter_2")
    backend.makedirs(ckpt)
    _write(backend, backend.join(ckpt, "__0_0.distcp"), b"data")
    commit = RecordCommit(backend, ckpt)
    assert not commit.is_committed() and not is_committed_listing(backend.scan(ckpt))
    with pytest.raises(RuntimeError, match="boom"):
        commit.commit(lambda f: (f.write(b"partial"), _raise_boom()))
    assert not commit.is_committed()  # a failed commit leaves no record
    commit.commit(lambda f: f.write(b"record"))
    assert commit.is_committed() and is_committed_listing(backend.scan(ckpt))
    assert _read(backend, commit.record_path) == b"record"
    commit.uncommit()
    assert not commit.is_committed() and backend.exists(backend.join(ckpt, "__0_0.distcp"))
    commit.uncommit()  # already uncommitted is fine
    commit.commit(lambda f: f.write(b"again"))
    commit.discard()
    assert not backend.exists(ckpt)


def _raise_boom() -> None:
    raise RuntimeError("boom")


def test_posix_record_commit(tmp_path) -> None:
    check_record_commit(PosixBackend(), str(tmp_path))


def test_msc_record_commit(msc_store) -> None:
    check_record_commit(get_backend(msc_store.url()), msc_store.url())
