"""Verified reading of local copies: mapped and read paths, fast CRC implementations."""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from resilient_ckpt import _checksum
from resilient_ckpt.errors import ConfigurationError, CorruptCheckpointError
from resilient_ckpt.local import _verified_read


def _write(path, data: bytes) -> tuple[int, int]:
    with open(path, "wb") as f:
        f.write(data)
    return len(data), zlib.crc32(data)


@pytest.mark.parametrize("name", list(_checksum.implementations()))
def test_every_crc_implementation_is_zlibs(name):
    crc = _checksum.implementations()[name]
    data = os.urandom(3 << 20) + b"tail"
    assert crc(data, 0) == zlib.crc32(data)
    value = 0
    for start in range(0, len(data), 1 << 20):  # continued chunk by chunk, as when reading
        value = crc(memoryview(data)[start : start + (1 << 20)], value)
    assert value == zlib.crc32(data)


def test_crc_pipe_matches_zlib():
    data = os.urandom(1 << 20)
    pipe = _checksum.CrcPipe()
    for start in range(0, len(data), 4096):
        pipe.feed(memoryview(data)[start : start + 4096])
    assert pipe.result() == zlib.crc32(data)


@pytest.mark.parametrize("mmap_env", ["1", "0"])
def test_both_paths_read_exact_bytes_and_reject_damage(tmp_path, monkeypatch, mmap_env):
    monkeypatch.setenv("RESILIENT_CKPT_LOCAL_LOAD_MMAP", mmap_env)
    data = os.urandom((1 << 20) + 77)
    path = str(tmp_path / "copy.pt")
    size, crc = _write(path, data)
    out = _verified_read.read_verified(path, size, crc)
    assert out.dtype == torch.uint8 and bytes(out.numpy()) == data
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        _verified_read.read_verified(path, size, crc ^ 1)
    with pytest.raises(CorruptCheckpointError, match="size differs"):
        _verified_read.read_verified(path, size + 1, crc)
    empty = str(tmp_path / "empty.pt")
    assert _verified_read.read_verified(empty, *_write(empty, b"")).numel() == 0


def test_mapped_copy_is_private_and_outlives_the_file(tmp_path):
    data = bytes(range(256)) * 4096
    path = str(tmp_path / "copy.pt")
    size, crc = _write(path, data)
    out = _verified_read.read_verified(path, size, crc)
    out[:16] = 0  # copy-on-write: the file keeps the verified bytes
    with open(path, "rb") as f:
        assert f.read() == data
    os.unlink(path)  # retention may delete a copy while its loaded state is in use
    assert bytes(out[16:].numpy()) == data[16:]
    assert int(out[:16].sum()) == 0


def test_bad_mmap_setting_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("RESILIENT_CKPT_LOCAL_LOAD_MMAP", "maybe")
    path = str(tmp_path / "copy.pt")
    with pytest.raises(ConfigurationError, match="LOCAL_LOAD_MMAP"):
        _verified_read.read_verified(path, *_write(path, b"x"))
