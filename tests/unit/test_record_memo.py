"""A state planned in full at every save (any TensorAwareStateDict but a steady
BasicTensorAwareStateDict) reuses the last planning's tensor records while its tensors keep
their record keys; any change gives the records a fresh planning gives
(resilient_ckpt.local._format.RecordMemo)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from resilient_ckpt.errors import ConfigurationError
from resilient_ckpt.local._format import RecordMemo, deserialize, plan_shard, serialize
from tests import _helpers

CHANGES = _helpers.LIST_STATE_CHANGES


def test_records_are_reused_while_the_tensors_keep_their_keys() -> None:
    tensors = [torch.rand(4) for _ in range(6)]
    memo = RecordMemo()
    first = plan_shard(_helpers.ListState(tensors, 1), memo)
    tensors[0].add_(1)  # new values, same keys
    again = plan_shard(_helpers.ListState([t.clone() for t in tensors], 2), memo)
    assert again.records is first.records
    assert again.header == plan_shard(_helpers.ListState(tensors, 2)).header


@pytest.mark.parametrize("what,change", CHANGES, ids=[c[0] for c in CHANGES])
def test_a_changed_tensor_gets_fresh_records(
    what: str, change: Callable[[list[torch.Tensor]], None]
) -> None:
    tensors = [torch.rand(4) for _ in range(6)]
    memo = RecordMemo()
    plan_shard(_helpers.ListState(tensors, 1), memo)
    change(tensors)
    got = plan_shard(_helpers.ListState(tensors, 2), memo)
    want = plan_shard(_helpers.ListState(tensors, 2))
    assert list(got.records) == list(want.records), what
    assert got.header == want.header, what
    loaded = deserialize(serialize(got))
    assert [t.dtype for t in loaded.tensors] == [t.dtype for t in tensors]
    assert [type(t) for t in loaded.tensors] == [
        torch.nn.Parameter if isinstance(t, torch.nn.Parameter) else torch.Tensor for t in tensors
    ]


def test_a_tensor_that_cannot_be_stored_is_refused_with_a_memo_too() -> None:
    tensors = [torch.rand(4), torch.rand(3)]
    memo = RecordMemo()
    plan_shard(_helpers.ListState(tensors, 1), memo)
    tensors[1] = torch.eye(3).to_sparse()
    with pytest.raises(ConfigurationError, match="tensor #1"):
        plan_shard(_helpers.ListState(tensors, 2), memo)
