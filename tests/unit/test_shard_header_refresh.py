"""A local save whose plain values changed (the iteration, the learning rate) but not its
structure reuses the shard layout and makes only the header again; that header is byte for
byte the one a full planning writes (resilient_ckpt.local._shard_cache)."""

from __future__ import annotations

import torch

from resilient_ckpt.local import BasicTensorAwareStateDict
from resilient_ckpt.local._format import plan_shard
from resilient_ckpt.local._shard_cache import ShardPlanCache


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
    got = cache.plan(BasicTensorAwareStateDict(state), plan_shard)
    want = plan_shard(BasicTensorAwareStateDict(state))
    assert got.header == want.header
    assert (got.data_start, got.size) == (want.data_start, want.size)
    assert list(got.records) == list(want.records)
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
    for n, change in enumerate(changes, start=1):
        change()
        _check(cache, state)
        assert (cache.hits, cache.refreshes, cache.misses) == (n, n, 1)
    _check(cache, state)  # same values again: the plain hit
    assert (cache.hits, cache.refreshes, cache.misses) == (len(changes) + 1, len(changes), 1)


def test_a_changed_structure_is_still_planned_in_full() -> None:
    state = _state()
    cache = ShardPlanCache()
    _check(cache, state)
    state["step"] = 2.5  # an int became a float: a different structure token
    _check(cache, state)
    state["model"]["layer3.w"] = torch.rand(5)
    _check(cache, state)
    assert (cache.hits, cache.refreshes, cache.misses) == (0, 0, 3)


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
        _check(cache, state)
    # The first save planned in full, the others refreshed (state_dict() makes new objects
    # every time: new OrderedDicts, new detached tensors over the same storages).
    assert (cache.hits, cache.refreshes, cache.misses) == (3, 3, 1)
    state["model"]._metadata[""]["version"] = 2  # type: ignore[attr-defined]
    _check(cache, state)
    assert cache.misses == 2  # the module attributes are part of the structure
