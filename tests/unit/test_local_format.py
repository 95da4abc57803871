"""The local shard format: exact round trips, identical bytes on every path, checksums."""

from __future__ import annotations

import io
import os
import pickle
import random
import zlib
from collections import OrderedDict
from typing import Any

import pytest
import torch

from resilient_ckpt.errors import ConfigurationError, CorruptCheckpointError
from resilient_ckpt.local import BasicTensorAwareStateDict, LocalCheckpointManager
from resilient_ckpt.local._format import (
    ShardBuffer,
    ShardLayout,
    deserialize,
    header_of,
    read_verified,
    serialize,
    stream_to,
)
from resilient_ckpt.local._shard_cache import plan_shard
from resilient_ckpt.utils import diff
from tests import _helpers


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


def _save_and_load(root: str, state: dict, iteration: int = 1) -> dict:
    """``state`` saved as ``iteration`` by a local manager, and loaded back by another."""
    LocalCheckpointManager(root, "s").save(BasicTensorAwareStateDict(state), iteration)
    loader = LocalCheckpointManager(root, "s")
    assert loader.find_latest() == iteration
    return loader.load()[0].state_dict  # type: ignore[attr-defined,no-any-return]


class _Holder:
    """A custom object in the state, referring to a dict of tensors the state holds too."""

    def __init__(self, ref: dict) -> None:
        self.ref = ref


def _training_state() -> dict:
    """A model's state_dict (an OrderedDict with ``_metadata``) and an Adam state after a
    step (a dict of tensors per parameter; tuples and plain values in its param groups)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.rand(2, 3)).sum().backward()
    optim.step()
    return {"model": model.state_dict(), "optim": optim.state_dict(), "step": 1}


def test_a_training_state_loads_back_with_its_types_attributes_and_sharing(tmp_path):
    state = _training_state()
    config = {"name": "run", "sizes": [1, 2]}
    inner = {"w": torch.rand(2)}
    weights = {"w": torch.rand(3), "b": torch.rand(2)}
    state.update(
        config=config,
        config_again=config,  # one dict, twice
        block={"inner": inner, "b": torch.rand(1)},
        alias=inner,  # a dict of tensors also held inside another one
        weights=weights,
        holder=_Holder(weights),  # an object holding a dict of tensors the state holds
        tied=state["model"]["0.weight"],  # one tensor, twice
    )
    loaded = _save_and_load(str(tmp_path), state)
    holder = loaded.pop("holder")  # compared below: diff compares other objects by ==
    assert diff({k: v for k, v in state.items() if k != "holder"}, loaded) == ([], [], [])
    assert type(loaded["model"]) is OrderedDict
    assert loaded["model"]._metadata == state["model"]._metadata
    assert loaded["optim"]["param_groups"] == state["optim"]["param_groups"]
    assert type(loaded["optim"]["param_groups"][0]["betas"]) is tuple
    assert loaded["config_again"] is loaded["config"]
    assert loaded["alias"] is loaded["block"]["inner"]
    assert holder.ref is loaded["weights"]
    assert torch.equal(holder.ref["w"], weights["w"])


def test_random_states_load_back_as_saved(tmp_path):
    """Random structures, saved again with a changed plain value and a config dict shared by
    identity from the second save on: each load is the state of its save."""
    rng = random.Random(13)
    for n in range(20):
        config = {"lr": 0.1, "tags": ["a"]}
        state = {
            "body": _helpers.random_nested_state(rng),
            "config": config,
            "again": dict(config),
            "it": 1,
        }
        root = str(tmp_path / str(n))
        for iteration in (1, 2):
            loaded = _save_and_load(root, state, iteration)
            assert diff(state, loaded) == ([], [], [])
            assert _helpers.skeleton(loaded) == _helpers.skeleton(state)
            assert (loaded["again"] is loaded["config"]) == (iteration == 2)
            state.update(it=iteration + 1, again=config)


class _PickledOnce:
    """How versions before issue 33 wrote parts of a shard header: pickled once, then
    spliced into every header as ``pickle.loads(payload)``."""

    def __init__(self, obj: Any) -> None:
        self.payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return pickle.loads, (self.payload,)


def _spliced_layout(state: dict) -> ShardLayout:
    """The shard of ``state`` with the header those versions wrote (byte for byte, checked
    against their ``plan_shard`` when they were removed): the records, the model's
    state_dict and the optimizer's per-parameter state each spliced in pickled."""
    layout = plan_shard(BasicTensorAwareStateDict(state))
    hollow = BasicTensorAwareStateDict(state)
    tensors = hollow.pop_tensors()
    tree = hollow.state_dict
    optim = dict(tree["optim"], state=_PickledOnce(tree["optim"]["state"]))
    hollow.state_dict = dict(tree, model=_PickledOnce(tree["model"]), optim=optim)
    _, records = pickle.loads(layout.header[len(header_of(b"")) :])
    body = pickle.dumps((hollow, _PickledOnce(records)), pickle.HIGHEST_PROTOCOL)
    hollow.state_dict = tree
    hollow.insert_tensors(tensors)  # back into the state's dicts, popped in place
    return ShardLayout(header_of(body), tensors, layout.offsets, layout.data_bytes)


def test_a_header_with_spliced_parts_still_loads():
    state = _training_state()
    state.update(config={"name": "run"}, tied=state["model"]["0.weight"])
    state["config_again"] = state["config"]
    old = _spliced_layout(state)
    assert b"loads" in old.header  # the splices' pickle.loads calls
    loaded = deserialize(serialize(old)).state_dict  # type: ignore[attr-defined]
    assert diff(state, loaded) == ([], [], [])
    assert type(loaded["model"]) is OrderedDict
    assert loaded["model"]._metadata == state["model"]._metadata
    assert loaded["optim"]["param_groups"] == state["optim"]["param_groups"]
    assert loaded["config_again"] is loaded["config"]
    assert isinstance(loaded["optim"]["state"][0]["exp_avg"], torch.Tensor)
