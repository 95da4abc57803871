"""The staging cache's layout check, with PyTorch's C++ tensor guard and without it."""

from __future__ import annotations

import pytest
import torch

from resilient_ckpt.async_ckpt import _layout_check
from resilient_ckpt.async_ckpt._layout_check import LayoutCheck, guard_factory


@pytest.fixture(params=["guard", "python"])
def implementation(request, monkeypatch):
    if request.param == "python":
        monkeypatch.setattr(_layout_check, "guard_factory", lambda: None)
    elif guard_factory() is None:
        pytest.fail("this torch's tensor guard failed the probe; see _layout_check")
    return request.param


def _tensors() -> list[torch.Tensor]:
    torch.manual_seed(0)
    base = torch.randn(16)
    return [
        torch.randn(4, 3),
        base,
        base[2:6],
        torch.nn.Parameter(torch.randn(5)),
        torch.arange(6, dtype=torch.int32),
        torch.empty(0),
    ]


def _full_and_prefix() -> tuple[torch.Tensor, torch.Tensor]:
    """Two tensors alike in everything but their storage's size (same address)."""
    storage = torch.zeros(16).untyped_storage()
    whole = torch.empty(0).set_(storage, 0, (4,), (1,))
    prefix = torch.empty(0).set_(storage[0:16], 0, (4,), (1,))
    return whole, prefix


CHANGES = {
    "shape": lambda t: t.__setitem__(0, t[0].view(3, 4)),
    "stride": lambda t: t.__setitem__(0, t[0].t().contiguous().t()),
    "stride, same memory": lambda t: t.__setitem__(0, t[0].as_strided((4, 3), (1, 4))),
    "dtype, same size": lambda t: t.__setitem__(4, t[4].view(torch.float32)),
    "dtype": lambda t: t.__setitem__(4, t[4].to(torch.int64)),
    "requires_grad": lambda t: t[3].requires_grad_(False),
    "type": lambda t: t.__setitem__(3, t[3].data),
    "storage offset": lambda t: t.__setitem__(2, t[1][3:7]),
    "other memory": lambda t: t.__setitem__(1, t[1].clone()),
    "storage swapped": lambda t: t[0].set_(torch.randn(4, 3)),
    "device": lambda t: t.__setitem__(5, torch.empty(0, device="meta")),
    "layout": lambda t: t.__setitem__(0, t[0].to_sparse()),
    "not a tensor": lambda t: t.__setitem__(5, 3),
    "one more": lambda t: t.append(torch.zeros(1)),
    "one fewer": lambda t: t.pop(),
}


def test_an_unchanged_layout_matches(implementation) -> None:
    tensors = _tensors()
    check = LayoutCheck(tensors)
    assert check.native == (implementation == "guard")
    for t in tensors:
        t.data.add_(1)  # values change, the layout does not
    assert check.matches(tensors)
    assert check.matches(list(tensors))  # other objects, same tensors
    same_memory = [
        torch.empty(0, dtype=t.dtype).set_(
            t.untyped_storage(), t.storage_offset(), t.shape, t.stride()
        )
        for t in tensors
    ]
    same_memory[3] = torch.nn.Parameter(same_memory[3])
    assert check.matches(same_memory)  # new objects over the same memory and layout


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_every_field_of_the_layout_is_checked(implementation, change) -> None:
    tensors = _tensors()
    check = LayoutCheck(tensors)
    changed = list(tensors)
    CHANGES[change](changed)
    assert not check.matches(changed)


def test_the_storage_size_is_checked(implementation) -> None:
    whole, prefix = _full_and_prefix()
    assert whole.data_ptr() == prefix.data_ptr()
    assert not LayoutCheck([whole]).matches([prefix])
    assert LayoutCheck([prefix]).matches([prefix])


def test_a_tensor_met_twice_is_checked_from_python() -> None:
    tensors = _tensors()
    twice = [*tensors, tensors[0]]
    check = LayoutCheck(twice)
    assert not check.native
    assert check.matches(twice)
    assert not check.matches([*tensors, tensors[1]])
    if guard_factory() is not None:  # with the guard, a tensor newly met twice misses
        assert not LayoutCheck(_tensors() + [torch.randn(4, 3)]).matches(twice)


def test_the_guard_is_usable_on_the_torch_versions_it_is_known_in() -> None:
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    if (2, 3) <= (major, minor) < (3, 0):
        assert guard_factory() is not None, torch.__version__


def test_the_probe_rejects_a_guard_that_misses_a_field(monkeypatch) -> None:
    """A guard that ignored strides (say, a future torch's) is not used."""
    from torch._C._dynamo import guards

    class _NoStrides:
        def __init__(self, *tensors, dynamic_dims_sizes, dynamic_dims_strides) -> None:
            self._shapes = [(type(t), t.dtype, t.shape, t.requires_grad) for t in tensors]

        def check(self, *tensors) -> bool:
            return [(type(t), t.dtype, t.shape, t.requires_grad) for t in tensors] == self._shapes

    monkeypatch.setattr(guards, "TensorGuards", _NoStrides)
    assert _layout_check._guard_factory() is None
    monkeypatch.setattr(guards, "TensorGuards", None)  # unusable: construction raises
    assert _layout_check._guard_factory() is None
