"""``read_and_forward`` (recovery's forwarding, ``local/replication/_forward``): the chunks
it sends are the file's, checksummed before they go; a file it cannot read is still sent
in full (zeros), so the receiver never waits for bytes that do not come, and the error is
raised after."""

from __future__ import annotations

import os

import pytest
import torch

from resilient_ckpt._checksum import crc32
from resilient_ckpt.errors import CorruptCheckpointError
from resilient_ckpt.local._manifest import CopyInfo
from resilient_ckpt.local.replication import _chunked, _forward


class _Done:
    def wait(self) -> None:
        pass


def _copy(path: str, data: bytes) -> CopyInfo:
    return CopyInfo(20, 1, 0, len(data), crc32(data), 2, None, path)


def _forwarded(copy: CopyInfo) -> tuple[list[tuple[int, bytes]], object]:
    sent: list[tuple[int, bytes]] = []

    def send(chunk: torch.Tensor, index: int) -> _Done:
        sent.append((index, bytes(chunk.numpy().tobytes())))
        return _Done()

    try:
        result: object = _forward.read_and_forward(copy, send)
    except Exception as exc:
        result = exc
    return sent, result


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(_chunked, "CHUNK_BYTES", 1000)


def test_a_good_copy_is_sent_chunk_by_chunk_and_returned(tmp_path, small_chunks) -> None:
    data = os.urandom(3500)
    path = tmp_path / "copy"
    path.write_bytes(data)
    sent, result = _forwarded(_copy(str(path), data))
    assert [i for i, _ in sent] == [0, 1, 2, 3] and b"".join(b for _, b in sent) == data
    assert isinstance(result, torch.Tensor) and bytes(result.numpy().tobytes()) == data


def test_a_corrupt_copy_is_sent_then_refused(tmp_path, small_chunks) -> None:
    data = os.urandom(3500)
    path = tmp_path / "copy"
    path.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    sent, result = _forwarded(_copy(str(path), data))
    assert len(sent) == 4  # the receiver gets every byte and checks them itself
    assert isinstance(result, CorruptCheckpointError) and "checksum" in str(result)


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_an_unreadable_copy_is_sent_as_zeros(tmp_path, small_chunks, damage) -> None:
    data = os.urandom(3500)
    path = tmp_path / "copy"
    if damage == "truncated":
        path.write_bytes(data[:1200])
    sent, result = _forwarded(_copy(str(path), data))
    assert [i for i, _ in sent] == [0, 1, 2, 3]
    assert b"".join(b for _, b in sent) == bytes(3500)
    expected = FileNotFoundError if damage == "missing" else CorruptCheckpointError
    assert isinstance(result, expected), result
