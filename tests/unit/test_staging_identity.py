"""Staging keeps the request's object graph: a tensor object met twice is one object in the
worker, an alias of it (another object over the same memory) two objects over one slot, a
dict met twice one dict, on steady saves too. The torch.save flow's archive is compared with
``torch.save``'s in ``test_torch_ckpt_state.py``."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from resilient_ckpt.async_ckpt._staging import ArenaPool, stage, unstage
from resilient_ckpt.async_ckpt._structure import StageCache
from tests.unit.test_torch_ckpt_state import _training_state


def _never() -> bool:
    return False


def _weights(n: int = 8) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((3,), float(i)) for i in range(n)}


class _Stager:
    """Stages a state as the torch.save flow does and unstages it; the arena of the last
    one stays mapped (the unstaged tensors view it) until the next one or ``close``."""

    def __init__(self) -> None:
        self.pool = ArenaPool(1)
        self.cache = StageCache()
        self.arena_id: int | None = None

    def __call__(self, state: dict, *, cached: bool = False) -> dict:
        self._release()
        staged = stage(state, self.pool, _never, cache=self.cache if cached else None)
        self.arena_id = staged.arena.arena_id
        return unstage(staged.payload, staged.arena, staged.slots)

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


def test_a_module_state_keeps_its_types_and_metadata(stager: _Stager) -> None:
    _, state = _training_state(3)
    got = stager(state)
    assert type(got["model"]) is OrderedDict
    assert list(got["model"]) == list(state["model"])
    assert got["model"]._metadata == state["model"]._metadata  # the module versions
    assert all(torch.equal(got["model"][k], v) for k, v in state["model"].items())


def test_a_dict_met_twice_stays_one_object(stager: _Stager) -> None:
    shared = _weights()
    got = stager({"a": shared, "b": shared, "r": {f"w{i}": shared["w0"] for i in range(8)}})
    assert got["a"] is got["b"]
    assert all(t is got["a"]["w0"] for t in got["r"].values())


def test_two_dicts_sharing_a_tensor_share_it_in_the_worker(stager: _Stager) -> None:
    first = _weights()
    second = {**_weights(), "w0": first["w0"]}
    got = stager({"a": first, "b": second})
    assert got["a"]["w0"] is got["b"]["w0"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["before", "after", "deeper", "key"])
def test_a_tensor_met_again_stays_one_object(stager: _Stager, where: str) -> None:
    weights = _weights()
    again = weights["w3"]
    state = {
        "before": {"x": again, "m": weights},
        "after": {"m": weights, "x": again},
        "deeper": {"m": weights, "opt": {"state": {0: {"exp_avg": [again]}}}},
        "key": {"m": weights, "x": {again: 1}},
    }[where]
    got = stager(state)
    met = {
        "before": lambda: got["x"],
        "after": lambda: got["x"],
        "deeper": lambda: got["opt"]["state"][0]["exp_avg"][0],
        "key": lambda: next(iter(got["x"])),
    }[where]()
    assert met is got["m"]["w3"]
    assert all(torch.equal(got["m"][k], v) for k, v in weights.items())


@pytest.mark.timeout(60)
def test_a_tensor_pickled_by_value_stays_one_object(stager: _Stager) -> None:
    weights = {**_weights(), "c": torch.randn(3, dtype=torch.complex64).conj()}
    got = stager({"m": weights, "x": weights["w1"], "y": weights["c"]})
    assert got["x"] is got["m"]["w1"] and got["y"] is got["m"]["c"]
    assert torch.equal(got["y"], weights["c"])


@pytest.mark.timeout(60)
def test_steady_saves_tell_a_tensor_met_twice_from_an_alias(stager: _Stager) -> None:
    """Staged with the staging cache, switching between a tensor met twice and an alias of
    it (same layout, another object): the one stays one object, the other two, and every
    save has its own values. (The cache's hits over these rounds are in
    ``test_performance_contract.py``.)"""
    weights = _weights()
    alias = weights["w0"].detach()
    apart = {"m": weights, "x": alias}
    twice = {"m": weights, "x": weights["w0"]}
    for i, state in enumerate([apart, apart, twice, twice, apart, apart]):
        weights["w0"].add_(1)  # new values every save: a stale staging would show
        got = stager(state, cached=True)
        assert torch.equal(got["x"], state["x"]) and torch.equal(got["m"]["w0"], weights["w0"]), i
        assert (got["x"] is got["m"]["w0"]) == (state is twice), i
        assert got["x"].untyped_storage().data_ptr() == got["m"]["w0"].untyped_storage().data_ptr()
