"""A local save whose plain values changed (the iteration, the learning rate) but not its
structure gets, from the shard layout cache (resilient_ckpt.local._shard_cache), a header
byte for byte the one a full planning writes, and a changed structure the full planning's
layout. (That the first only refreshes the header is in ``test_performance_contract.py``.)"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any
from unittest import mock

import torch

from resilient_ckpt.local import BasicTensorAwareStateDict, _shard_cache
from resilient_ckpt.local._format import deserialize, serialize
from resilient_ckpt.local._shard_cache import ShardPlanCache, plan_shard
from resilient_ckpt.utils import diff
from tests import _helpers


def _state() -> dict:
    shared_config = {"name": "run", "sizes": [1, 2]}  # no tensors: shared by identity
    weights = {f"layer{i}.w": torch.rand(3, i + 1) for i in range(40)}
    tag = "adamw"
    return {
        "model": weights,
        "optim": {
            "p": torch.nn.Parameter(torch.rand(2)),
            "state": [{"m": torch.rand(2), "step": 1}, (torch.zeros(1), 0.9, tag)],
            "kind": tag,
        },
        "config": shared_config,
        "config_again": shared_config,
        "tied": weights["layer0.w"],  # the same tensor object twice
        "step": 1,
        "lr": 0.1,
        "note": None,
        "raw": b"x",
    }


def _check(cache: ShardPlanCache, state: dict) -> None:
    got = plan_shard(BasicTensorAwareStateDict(state), cache)
    want = plan_shard(BasicTensorAwareStateDict(state))
    assert got.header == want.header
    assert (got.data_start, got.size) == (want.data_start, want.size)
    assert got.offsets == want.offsets
    assert len(got.tensors) == len(want.tensors)
    assert all(a is b for a, b in zip(got.tensors, want.tensors, strict=True))


def test_refreshed_header_is_the_full_planning_header() -> None:
    state = _state()
    cache = ShardPlanCache()
    _check(cache, state)  # planned in full, cached
    changes = [
        lambda: state.update(step=2),
        lambda: state.update(lr=-0.0),
        lambda: state["optim"]["state"][0].update(step=7),
        lambda: state["config"].update(name="run2"),  # through both references
        lambda: state.update(step=10**40),  # a longer pickle: the data moves
        lambda: state["optim"].update(kind="sgd"),
    ]
    for change in changes:
        change()
        _check(cache, state)
    _check(cache, state)  # same values again


def test_a_changed_structure_is_still_planned_in_full() -> None:
    state = _state()
    cache = ShardPlanCache()
    _check(cache, state)
    state["step"] = 2.5  # an int became a float: a different structure token
    _check(cache, state)
    state["model"]["layer3.w"] = torch.rand(5)
    _check(cache, state)


def test_a_model_and_optimizer_state_dict_is_refreshed_too() -> None:
    """The usual state: ``model.state_dict()`` (an OrderedDict with ``_metadata``), an Adam
    state after a step (tensors keyed by int, param groups of plain values), the iteration."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    cache = ShardPlanCache()
    for iteration in range(1, 5):
        model(torch.rand(3, 4)).sum().backward()
        optim.step()
        for group in optim.param_groups:
            group["lr"] *= 0.5  # a schedule: a plain value changing every save
        state = {"model": model.state_dict(), "optim": optim.state_dict(), "it": iteration}
        _check(cache, state)  # state_dict() makes new objects (dicts, tensors) every time
    state["model"]._metadata[""]["version"] = 2  # type: ignore[attr-defined]
    _check(cache, state)  # the module attributes are part of the structure
    loaded = deserialize(serialize(plan_shard(BasicTensorAwareStateDict(state), cache)))
    assert loaded.state_dict["model"]._metadata == state["model"]._metadata  # type: ignore[attr-defined]


class _Holder:
    """A custom object in the state: it refers to a dict of tensors the state holds too."""

    def __init__(self, ref: dict) -> None:
        self.ref = ref


def _training_state() -> dict:
    """A model's state_dict (an OrderedDict with attributes) and an Adam state after a step
    (a dict of tensors per parameter, tuples and plain values in its param groups)."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.rand(2, 3)).sum().backward()
    optim.step()
    return {"model": model.state_dict(), "optim": optim.state_dict(), "step": 1}


def test_parts_holding_only_tensors_travel_pickled_once_and_load_as_they_were() -> None:
    """The model's state_dict and the optimizer's per-parameter state are spliced into the
    header whole (resilient_ckpt.local._shard_cache); they load as the same types, attributes
    and values, and a refresh reuses their pickles instead of making them."""
    state = _training_state()
    with mock.patch.object(_shard_cache, "Pickled", wraps=_shard_cache.Pickled) as made:
        layout = plan_shard(BasicTensorAwareStateDict(state))
    assert made.call_count == 3  # the records, and the two outermost parts holding only tensors
    loaded = deserialize(serialize(layout)).state_dict  # type: ignore[attr-defined]
    assert type(loaded["model"]) is OrderedDict
    assert loaded["model"]._metadata == state["model"]._metadata  # type: ignore[attr-defined]
    assert loaded["optim"]["param_groups"] == state["optim"]["param_groups"]
    assert diff(state, loaded) == ([], [], [])
    cache = ShardPlanCache()
    _check(cache, state)
    state["step"] = 2
    state["optim"]["param_groups"][0]["lr"] = 5e-4
    with mock.patch.object(_shard_cache, "Pickled", side_effect=AssertionError("re-made")):
        got = plan_shard(BasicTensorAwareStateDict(state), cache)
    assert got.header == plan_shard(BasicTensorAwareStateDict(state)).header


def test_sharing_and_spliced_parts_follow_the_state_of_each_save() -> None:
    """Dicts shared by identity at one save and not at the next, or a part holding only
    tensors that gains a plain value, are a new structure (planned in full); the saves after
    each refresh the header, always the full planning's bytes."""
    state = _training_state()
    config = {"name": "run", "sizes": (1, 2)}
    state.update(config=config, config_again=dict(config))
    cache = ShardPlanCache()
    changes = [
        lambda: state.update(config_again=config),  # now the same object twice
        lambda: state.update(config_again=dict(config)),  # and two again
        lambda: state["optim"]["state"][0].update(note="warm"),  # not only tensors now
    ]
    _check(cache, state)
    for step, change in enumerate(changes, start=2):
        state["step"] = step
        _check(cache, state)  # refreshed
        change()
        _check(cache, state)  # planned in full


def test_a_part_holding_a_container_met_elsewhere_is_not_spliced() -> None:
    """A dict inside a part holding only tensors, also held elsewhere in the state: after
    loading, both places still hold the one dict."""
    inner = {"w": torch.rand(2)}
    state = {"model": {"block": inner, "b": torch.rand(1)}, "alias": inner, "step": 1}
    loaded = deserialize(serialize(plan_shard(BasicTensorAwareStateDict(state)))).state_dict  # type: ignore[attr-defined]
    assert loaded["alias"] is loaded["model"]["block"]
    assert torch.equal(loaded["alias"]["w"], inner["w"])


def test_a_state_with_other_objects_keeps_its_sharing() -> None:
    """An object the splice does not look into may share a dict of tensors with the state:
    the state is then pickled as it is, and after loading both still see the one dict."""
    weights = {"w": torch.rand(3), "b": torch.rand(2)}
    state = {"model": weights, "holder": _Holder(weights), "step": 1}
    layout = plan_shard(BasicTensorAwareStateDict(state))
    loaded = deserialize(serialize(layout)).state_dict  # type: ignore[attr-defined]
    assert loaded["holder"].ref is loaded["model"]
    assert torch.equal(loaded["holder"].ref["w"], weights["w"])


def _plain_leaves(obj: Any, path: tuple = ()) -> list[tuple]:
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in _plain_leaves(v, (*path, k))]
    if isinstance(obj, (list, tuple)):
        return [p for i, v in enumerate(obj) for p in _plain_leaves(v, (*path, i))]
    return [] if isinstance(obj, torch.Tensor) else [(obj, path)]


def test_random_states_refresh_to_the_full_planning_header() -> None:
    """Random structures, saved again with changed plain values or a shared config dict
    swapped in and out: every header the cache gives is the full planning's, and loads back
    to the saved state."""
    rng = random.Random(13)
    for _ in range(40):
        config = {"lr": 0.1, "tags": ["a"]}
        state = {
            "body": _helpers.random_nested_state(rng, signed_zero=False),
            "config": config,
            "again": dict(config),
            "it": 0,
        }
        cache = ShardPlanCache()
        for it in range(1, 5):
            state["it"] = it
            if it == 3:
                state["again"] = config  # shared from now on
            _check(cache, state)
        layout = plan_shard(BasicTensorAwareStateDict(state), cache)
        loaded = deserialize(serialize(layout)).state_dict  # type: ignore[attr-defined]
        assert diff(state, loaded) == ([], [], [])
        assert _plain_leaves(loaded) == _plain_leaves(state)
        assert loaded["again"] is loaded["config"]
