"""The torch.save flow stages a dict of tensors (a model's state_dict) as one batch
(``_staging.TensorDict``), and stages the state unbatched wherever a batch would rebuild a
tensor object met twice as two, on steady saves too (issue 33). The flow's archive is
compared with ``torch.save``'s in ``test_torch_ckpt_state.py``."""

from __future__ import annotations

import copy
import pickle
from collections import OrderedDict

import pytest
import torch

from resilient_ckpt.async_ckpt._staging import (
    MIN_BATCHED,
    ArenaPool,
    BatchedWhenPickled,
    TensorDict,
    batch_tensor_dicts,
    stage,
    unstage,
)
from resilient_ckpt.async_ckpt._structure import StageCache
from tests.unit.test_torch_ckpt_state import _training_state


def _never() -> bool:
    return False


def _weights(n: int = MIN_BATCHED) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((3,), float(i)) for i in range(n)}


def test_state_is_batched_without_changing_the_callers_objects() -> None:
    _, state = _training_state(3)
    before = copy.copy(state)
    staged, batched = batch_tensor_dicts(state)
    assert state == before and staged is not state
    assert isinstance(staged["model"], TensorDict)
    assert batched == set(map(id, state["model"].values()))  # what single tensors check
    assert staged["optimizer"] is state["optimizer"]  # a dict of dicts: left as it is
    rebuilt = pickle.loads(pickle.dumps(staged))
    assert type(rebuilt["model"]) is OrderedDict
    assert list(rebuilt["model"]) == list(state["model"])
    assert rebuilt["model"]._metadata == state["model"]._metadata  # the module versions
    # Nothing to batch: the very object.
    small = {"a": torch.ones(2), "step": 1}
    assert batch_tensor_dicts(small) == (small, set())
    assert batch_tensor_dicts(small)[0] is small
    assert len(small) < MIN_BATCHED


def test_a_dict_met_twice_stays_one_object_and_repeated_tensors_are_not_batched() -> None:
    shared = _weights()
    rebuilt = pickle.loads(pickle.dumps(batch_tensor_dicts({"a": shared, "b": shared})[0]))
    assert rebuilt["a"] is rebuilt["b"]
    repeated = {f"w{i}": shared["w0"] for i in range(MIN_BATCHED)}
    assert batch_tensor_dicts({"m": repeated})[0]["m"] is repeated


def test_two_dicts_sharing_a_tensor_are_not_batched(stager: _Stager) -> None:
    first = _weights()
    second = {**_weights(), "w0": first["w0"]}
    state = {"a": first, "b": second}
    assert batch_tensor_dicts(state) == (state, set())
    got, batched = stager(state)
    assert got["a"]["w0"] is got["b"]["w0"] and not batched


class _Stager:
    """Stages a state as the torch.save flow does and unstages it; the arena of the last
    one stays mapped (the unstaged tensors view it) until the next one or ``close``."""

    def __init__(self) -> None:
        self.pool = ArenaPool(1)
        self.cache = StageCache()
        self.arena_id: int | None = None

    def __call__(self, state: dict, *, cached: bool = False) -> tuple[dict, bool]:
        """The unstaged state and whether it was batched."""
        self._release()
        staged = stage(
            BatchedWhenPickled(state), self.pool, _never, cache=self.cache if cached else None
        )
        self.arena_id = staged.arena.arena_id
        got = unstage(staged.payload, staged.arena, staged.slots)
        return got, b"rebuild_batch" in staged.payload

    def _release(self) -> None:
        if self.arena_id is not None:
            self.pool.release(self.arena_id)
            self.arena_id = None

    def close(self) -> None:
        self._release()
        self.pool.close()


@pytest.fixture
def stager():
    staging = _Stager()
    yield staging
    staging.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["before", "after", "deeper", "key"])
def test_a_batched_tensor_met_again_stays_one_object(stager: _Stager, where: str) -> None:
    weights = _weights()
    again = weights["w3"]
    state = {
        "before": {"x": again, "m": weights},
        "after": {"m": weights, "x": again},
        "deeper": {"m": weights, "opt": {"state": {0: {"exp_avg": [again]}}}},
        "key": {"m": weights, "x": {again: 1}},
    }[where]
    assert batch_tensor_dicts(state)[1]  # the dict alone would be a batch
    got, batched = stager(state)
    assert not batched
    met = {
        "before": lambda: got["x"],
        "after": lambda: got["x"],
        "deeper": lambda: got["opt"]["state"][0]["exp_avg"][0],
        "key": lambda: next(iter(got["x"])),
    }[where]()
    assert met is got["m"]["w3"]
    assert all(torch.equal(got["m"][k], v) for k, v in weights.items())


@pytest.mark.timeout(60)
def test_a_batch_pickled_by_value_keeps_its_tensors_one_object(stager: _Stager) -> None:
    weights = {**_weights(), "c": torch.randn(3, dtype=torch.complex64).conj()}
    got, _ = stager({"m": weights, "x": weights["w1"], "y": weights["c"]})
    assert got["x"] is got["m"]["w1"] and got["y"] is got["m"]["c"]
    assert torch.equal(got["y"], weights["c"])


@pytest.mark.timeout(60)
def test_steady_saves_keep_a_tensor_met_twice_one_object(stager: _Stager) -> None:
    """Staged with the staging cache, switching between a tensor met twice and an alias of
    it (another object over the same memory, the same layout): a tensor met twice stays one
    object and an alias two, and a state that staged unbatched stays unbatched. (The cache's
    hits over these rounds are in ``test_performance_contract.py``.)"""
    weights = _weights()
    alias = weights["w0"].detach()
    apart = {"m": weights, "x": alias}
    twice = {"m": weights, "x": weights["w0"]}
    rounds = [  # state, batched
        (apart, True),
        (apart, True),
        (twice, False),  # same layouts as `apart`: only identity tells them apart
        (twice, False),
        (apart, True),
        (apart, True),
    ]
    for i, (state, batched) in enumerate(rounds):
        weights["w0"].add_(1)  # new values every save: a stale staging would show
        got, was_batched = stager(state, cached=True)
        assert was_batched == batched, i
        assert torch.equal(got["x"], state["x"]) and torch.equal(got["m"]["w0"], weights["w0"]), i
        assert (got["x"] is got["m"]["w0"]) == (state is twice), i
        assert got["x"].untyped_storage().data_ptr() == got["m"]["w0"].untyped_storage().data_ptr()
