"""BasicTensorAwareStateDict: the NVRx TensorAwareStateDict semantics, CPU and CUDA."""

from __future__ import annotations

import copyreg
import io
import pickle
from collections import namedtuple

import pytest
import torch

from resilient_ckpt.errors import CheckpointingException
from resilient_ckpt.local import BasicTensorAwareStateDict, TensorAwareStateDict
from resilient_ckpt.local.basic_state_dict import TensorPlaceholder
from resilient_ckpt.utils import diff

Pair = namedtuple("Pair", ["first", "second"])


def _state() -> dict:
    return {
        "a": torch.arange(6.0).reshape(2, 3),
        "nested": [torch.ones(2, dtype=torch.int32), (torch.zeros(1), "txt"), {"x": 1}],
        "pair": Pair(torch.tensor(3), 4),
        "plain": 1.5,
    }


def test_pop_insert_round_trip_keeps_structure_and_identity():
    sd = BasicTensorAwareStateDict(_state())
    assert isinstance(sd, TensorAwareStateDict)
    before = list(sd.tensors)
    popped = sd.pop_tensors()
    assert sd.is_hollow and len(popped) == 4
    assert all(a is b for a, b in zip(before, popped, strict=True))
    assert isinstance(sd.state_dict["a"], TensorPlaceholder)
    assert isinstance(sd.state_dict["pair"], Pair)
    sd.insert_tensors(popped)
    assert not sd.is_hollow
    assert diff(_state(), sd.state_dict) == ([], [], [])
    assert isinstance(sd.state_dict["pair"], Pair) and sd.state_dict["pair"].second == 4
    assert sd.state_dict["nested"][1][1] == "txt"


def test_misuse_is_an_error():
    sd = BasicTensorAwareStateDict(_state())
    with pytest.raises(CheckpointingException):
        sd.insert_tensors([])
    with pytest.raises(CheckpointingException):
        sd.init_tensors()
    tensors = sd.pop_tensors()
    with pytest.raises(CheckpointingException):
        sd.pop_tensors()
    with pytest.raises(CheckpointingException):
        list(sd.tensors)
    with pytest.raises(CheckpointingException):
        sd.insert_tensors(tensors[:-1])
    sd2 = BasicTensorAwareStateDict(_state())
    extra = sd2.pop_tensors() + [torch.zeros(1)]
    with pytest.raises(CheckpointingException):
        sd2.insert_tensors(extra)


def test_init_tensors_matches_shapes_and_dtypes():
    sd = BasicTensorAwareStateDict(_state())
    popped = sd.pop_tensors()
    sd.init_tensors()
    for new, old in zip(sd.tensors, popped, strict=True):
        assert new.shape == old.shape and new.dtype == old.dtype and new.device == old.device


def test_cpu_tensors_copy_and_restore_are_noops():
    state = _state()
    sd = BasicTensorAwareStateDict(state)
    sd.copy_tensors_to_cpu()
    sd.restore_tensor_device()
    assert sd.state_dict["a"] is state["a"]
    assert "state_dict" in dict(vars(sd)) and len(list(sd.values())) >= 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_restoring_a_cuda_tensor_without_cuda_is_a_clear_error():
    placeholder = TensorPlaceholder((2,), torch.float32, torch.device("cuda", 0))
    with pytest.raises(CheckpointingException, match="CUDA is not available"):
        placeholder.init_tensor()


@pytest.mark.gpu
def test_cuda_tensors_go_to_cpu_and_back():
    original = torch.randn(4, device="cuda")
    state = {"w": original, "c": torch.ones(2), "n": 3}
    sd = BasicTensorAwareStateDict(state)
    sd.copy_tensors_to_cpu()
    # In place, as NVRx's: the dict now holds the CPU copy; the CUDA tensor is not destroyed.
    assert sd.state_dict["w"].device.type == "cpu" and state["w"] is sd.state_dict["w"]
    assert original.device.type == "cuda"
    popped = sd.pop_tensors()
    assert sd.state_dict["w"].device.type == "cuda"  # placeholder remembers the origin
    sd.insert_tensors(popped)
    sd.restore_tensor_device(non_blocking=False)
    assert sd.state_dict["w"].device.type == "cuda" and sd.state_dict["c"].device.type == "cpu"
    assert torch.equal(sd.state_dict["w"], original)


class _DefaultReduce(pickle.Pickler):
    """Pickles placeholders the dataclass way, as shard headers were written before."""

    def reducer_override(self, obj):
        if type(obj) is TensorPlaceholder:
            return copyreg.__newobj__, (TensorPlaceholder,), dict(vars(obj))
        return NotImplemented


def test_placeholders_pickle_as_constructor_calls_and_old_headers_still_load():
    placeholder = TensorPlaceholder.of(torch.zeros(2, 3, dtype=torch.float16))
    new = pickle.dumps([placeholder, placeholder], protocol=pickle.HIGHEST_PROTOCOL)
    stream = io.BytesIO()
    _DefaultReduce(stream, protocol=pickle.HIGHEST_PROTOCOL).dump([placeholder, placeholder])
    old = stream.getvalue()
    assert len(new) < len(old)
    for payload in (new, old):
        first, second = pickle.loads(payload)
        assert first == placeholder and first is second  # shared, as in the header
        assert first.init_tensor().shape == (2, 3) and first.dtype == torch.float16
