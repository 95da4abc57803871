"""The staging cache's check: no save is ever served stale descriptors. A request staged
after one laid out alike, or after any change of layout, unstages to exactly itself. (That the
first reuses the plan and the others stage fully is in ``test_performance_contract.py``.)"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from resilient_ckpt.async_ckpt._staging import ArenaPool, stage, unstage
from resilient_ckpt.async_ckpt._structure import StageCache


def _never() -> bool:
    return False


def _tensors() -> list:
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
    "storage size": lambda t: t.__setitem__(
        1, torch.empty(0).set_(t[1].untyped_storage()[0:32], 0, (4,), (1,))
    ),
    "conjugate bit": lambda t: t.append(torch.tensor([1 + 2j]).conj()),
    "layout": lambda t: t.__setitem__(0, t[0].to_sparse()),
    "not a tensor": lambda t: t.__setitem__(5, 3),
    "one more": lambda t: t.append(torch.zeros(1)),
    "one fewer": lambda t: t.pop(),
}


def _stage_twice(first: list, then: Callable[[list], list]) -> bool:
    """Stage ``first``, then ``then(first)`` (made after the first staging) with the same
    cache: whether what the worker would unstage from the second equals it."""
    pool, cache = ArenaPool(2), StageCache()
    try:
        staged = stage(first, pool, _never, cache=cache)
        if staged.arena is not None:
            pool.release(staged.arena.arena_id)
        second = then(first)
        staged = stage(second, pool, _never, cache=cache)
        out = unstage(staged.payload, staged.arena, staged.slots)
        same = len(out) == len(second) and all(map(_equal, second, out))
        del out  # views of the arena, unmapped by close()
    finally:
        pool.close()
    return same


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and type(a) is type(b)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.requires_grad == b.requires_grad
            and torch.equal(
                a.detach().resolve_conj().to_dense(), b.detach().resolve_conj().to_dense()
            )
        )
    return a == b


@pytest.mark.timeout(60)
def test_an_unchanged_layout_stages_the_new_values() -> None:
    def new_values(tensors: list) -> list:
        for t in tensors:
            t.data.add_(1)  # the values change, the layouts do not
        return list(tensors)

    def same_memory(tensors: list) -> list:
        views = [
            torch.empty(0, dtype=t.dtype).set_(
                t.untyped_storage(), t.storage_offset(), t.shape, t.stride()
            )
            for t in new_values(tensors)
        ]
        views[3] = torch.nn.Parameter(views[3])  # new objects over the same memory
        return views

    for then in (new_values, same_memory):
        assert _stage_twice(_tensors(), then), then.__name__


@pytest.mark.timeout(60)
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_every_change_of_layout_stages_exactly(change) -> None:
    def changed(tensors: list) -> list:
        tensors = list(tensors)
        CHANGES[change](tensors)
        return tensors

    assert _stage_twice(_tensors(), changed), change
