"""The local shard format: exact round trips, identical bytes on every path, checksums."""

from __future__ import annotations

import io
import os
import zlib

import pytest
import torch

from resilient_ckpt.errors import ConfigurationError, CorruptCheckpointError
from resilient_ckpt.local import BasicTensorAwareStateDict
from resilient_ckpt.local._format import (
    ShardBuffer,
    deserialize,
    plan_shard,
    read_verified,
    serialize,
    stream_to,
)
from resilient_ckpt.utils import diff


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "f16": torch.randn(7, 3, generator=g).half(),
        "bf16": torch.randn(5, generator=g).bfloat16(),
        "f64": torch.randn(2, 2, generator=g).double(),
        "i8": torch.randint(-100, 100, (11,), generator=g, dtype=torch.int8),
        "bool": torch.rand(13, generator=g) > 0.5,
        "c64": torch.randn(3, generator=g, dtype=torch.complex64),
        "conj": torch.randn(3, generator=g, dtype=torch.complex64).conj(),  # a lazy bit: the
        "neg": torch._neg_view(torch.randn(4, generator=g)),  # values are stored
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "strided": torch.randn(6, 4, generator=g)[:, 1],
        "param": torch.nn.Parameter(torch.randn(3, generator=g)),
        "other": {"lr": 0.1, "names": ["a", "b"]},
    }


def test_round_trip_is_exact_and_state_is_left_intact():
    state = _state()
    sd = BasicTensorAwareStateDict(state)
    layout = plan_shard(sd)
    assert not sd.is_hollow and sd.state_dict["f16"] is state["f16"]
    loaded = deserialize(serialize(layout)).state_dict  # type: ignore[attr-defined]
    assert diff(state, loaded) == ([], [], [])
    for key in ("f16", "bf16", "bool", "c64", "scalar", "empty", "strided"):
        assert loaded[key].dtype == state[key].dtype and loaded[key].shape == state[key].shape
    assert isinstance(loaded["param"], torch.nn.Parameter) and loaded["param"].requires_grad


def test_streamed_file_equals_buffer_and_checksums_agree():
    layout = plan_shard(BasicTensorAwareStateDict(_state()))
    buffer = serialize(layout)
    f = io.BytesIO()
    size, crc = stream_to(f, layout)
    assert size == layout.size == buffer.numel()
    assert f.getvalue() == bytes(buffer.numpy())
    assert crc == zlib.crc32(f.getvalue())
    g = io.BytesIO()
    assert stream_to(g, buffer) == (size, crc)


def test_read_verified_detects_flips_and_truncation(tmp_path):
    layout = plan_shard(BasicTensorAwareStateDict(_state()))
    path = str(tmp_path / "shard")
    with open(path, "wb") as f:
        size, crc = stream_to(f, layout)
    assert torch.equal(read_verified(path, size, crc), serialize(layout))
    with open(path, "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        read_verified(path, size, crc)
    os.truncate(path, size - 1)
    with pytest.raises(CorruptCheckpointError, match="size"):
        read_verified(path, size, crc)


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ConfigurationError, match="cannot be pickled"):
        plan_shard(BasicTensorAwareStateDict({"t": torch.ones(1), "f": lambda: 0}))
    with pytest.raises(ConfigurationError, match="dense"):
        plan_shard(BasicTensorAwareStateDict({"s": torch.eye(3).to_sparse()}))
    with pytest.raises(CorruptCheckpointError, match="magic"):
        deserialize(torch.zeros(64, dtype=torch.uint8))


def test_shard_buffer_is_a_one_tensor_state():
    data = torch.arange(10, dtype=torch.uint8)
    shard = ShardBuffer(data)
    assert shard.tensors == [data] and not shard.is_hollow
    popped = shard.pop_tensors()
    assert shard.is_hollow
    shard.init_tensors()
    assert shard.data.numel() == 10
    shard.insert_tensors(popped)
    assert shard.data is data


def test_a_shard_with_a_known_checksum_is_written_with_that_checksum():
    buffer = serialize(plan_shard(BasicTensorAwareStateDict(_state())))
    f = io.BytesIO()
    assert stream_to(f, ShardBuffer(buffer, crc32=1234)) == (buffer.numel(), 1234)
    assert f.getvalue() == bytes(buffer.numpy())
    g = io.BytesIO()
    assert stream_to(g, ShardBuffer(buffer)) == (buffer.numel(), zlib.crc32(f.getvalue()))
