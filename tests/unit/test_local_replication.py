"""Clique layout, sender assignment and defaults of the replication strategies."""

from __future__ import annotations

import pytest

from resilient_ckpt.errors import ConfigurationError, NoReplicasAvailableError
from resilient_ckpt.local.replication import strategies
from resilient_ckpt.local.replication.group_utils import parse_group_sequence
from resilient_ckpt.local.replication.strategies import (
    LazyCliqueReplicationStrategy,
    assign_senders,
    default_replication_jump,
)


def test_cliques_follow_the_jump():
    assert parse_group_sequence(1, 2, 4) == [[0, 1], [2, 3]]
    assert parse_group_sequence(2, 2, 4) == [[0, 2], [1, 3]]
    assert parse_group_sequence(2, 3, 6) == [[0, 2, 4], [1, 3, 5]]
    cliques = parse_group_sequence(8, 2, 32)
    assert cliques[:3] == [[0, 8], [1, 9], [2, 10]] and [16, 24] in cliques and len(cliques) == 16


@pytest.mark.parametrize(("jump", "factor", "world"), [(1, 3, 4), (3, 2, 8), (2, 4, 12)])
def test_world_size_not_divisible_is_a_clear_error(jump, factor, world):
    with pytest.raises(ConfigurationError, match="divisible"):
        parse_group_sequence(jump, factor, world)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_bad_parameters(bad):
    with pytest.raises(ConfigurationError):
        parse_group_sequence(bad, 2, 4)


def _ids(*owners):
    return [(7, o, "") for o in owners]


def test_receivers_keep_their_own_copy():
    held = {0: set(_ids(0, 1)), 1: set(_ids(0, 1))}
    plan = assign_senders([0, 1], [_ids(0), _ids(1)], held)
    assert plan == [(0, 0, (7, 0, "")), (1, 1, (7, 1, ""))]


def test_senders_are_spread_over_the_holders():
    clique = [0, 1, 2, 3]
    held = {0: set(), 1: set(), 2: set(_ids(0, 1, 2, 3)), 3: set(_ids(0, 1, 2, 3))}
    plan = assign_senders(clique, [_ids(0), _ids(1), _ids(2), _ids(3)], held)
    senders = [s for s, r, _ in plan if s != r]
    assert sorted(senders) == [2, 3]


def test_no_holder_raises():
    with pytest.raises(NoReplicasAvailableError, match="valid copy"):
        assign_senders([0, 1], [_ids(0), []], {0: set(), 1: set()})


def test_default_jump_is_read_at_call_time(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert default_replication_jump() == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert default_replication_jump() == 3
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setattr(strategies.torch.cuda, "device_count", lambda: 0)
    assert default_replication_jump() == 1


def test_lazy_strategy_knows_its_parameters_before_building(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    lazy = LazyCliqueReplicationStrategy(replication_factor=2)
    assert lazy.replication_params() == {"strategy": "clique", "factor": 2, "jump": 4}
    assert lazy._replication_strategy is None
