"""A state planned in full at every save (any TensorAwareStateDict but a plain
BasicTensorAwareStateDict) and planned with the manager's memory writes, save after save,
the shard a fresh planning writes: while its tensors are described as before (the records
are then reused, resilient_ckpt.local._shard_cache) and after any change of them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from resilient_ckpt.errors import ConfigurationError
from resilient_ckpt.local._format import deserialize, serialize
from resilient_ckpt.local._shard_cache import ShardPlanCache, plan_shard
from tests import _helpers

CHANGES = _helpers.LIST_STATE_CHANGES


def test_new_values_in_the_same_tensors_give_the_fresh_shard() -> None:
    tensors = [torch.rand(4) for _ in range(6)]
    memo = ShardPlanCache()
    plan_shard(_helpers.ListState(tensors, 1), memo)
    tensors = [t.clone().add_(1) for t in tensors]  # new tensors and values, same layout
    got = plan_shard(_helpers.ListState(tensors, 2), memo)
    want = plan_shard(_helpers.ListState(tensors, 2))
    assert got.header == want.header and got.offsets == want.offsets
    assert bytes(serialize(got).numpy()) == bytes(serialize(want).numpy())


@pytest.mark.parametrize("what,change", CHANGES, ids=[c[0] for c in CHANGES])
def test_a_changed_tensor_gets_fresh_records(
    what: str, change: Callable[[list[torch.Tensor]], None]
) -> None:
    tensors = [torch.rand(4) for _ in range(6)]
    memo = ShardPlanCache()
    plan_shard(_helpers.ListState(tensors, 1), memo)
    change(tensors)
    got = plan_shard(_helpers.ListState(tensors, 2), memo)
    want = plan_shard(_helpers.ListState(tensors, 2))
    assert got.offsets == want.offsets, what
    assert got.header == want.header, what
    loaded = deserialize(serialize(got))
    assert [t.dtype for t in loaded.tensors] == [t.dtype for t in tensors]
    assert [type(t) for t in loaded.tensors] == [
        torch.nn.Parameter if isinstance(t, torch.nn.Parameter) else torch.Tensor for t in tensors
    ]


def test_a_tensor_that_cannot_be_stored_is_refused_with_a_memo_too() -> None:
    tensors = [torch.rand(4), torch.rand(3)]
    memo = ShardPlanCache()
    plan_shard(_helpers.ListState(tensors, 1), memo)
    tensors[1] = torch.eye(3).to_sparse()
    with pytest.raises(ConfigurationError, match="tensor #1"):
        plan_shard(_helpers.ListState(tensors, 2), memo)
