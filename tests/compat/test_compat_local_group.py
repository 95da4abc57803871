"""NVRx's ``GroupWrapper`` on three gloo ranks, and replication over groups it built.

Megatron-LM builds its replication groups with ``GroupWrapper.from_list_of_groups`` (any
partition of the ranks, cliques of different sizes allowed) and passes the wrapper to
``CliqueReplicationStrategy``; code that moves state dicts itself uses
``all_gather_batch`` and ``execute_plan``. Here the partition is ``{0, 2}`` and ``{1}``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from resilient_ckpt.local.basic_state_dict import BasicTensorAwareStateDict
from resilient_ckpt.local.ckpt_managers.local_manager import LocalCheckpointManager
from resilient_ckpt.local.replication.group_utils import ExchangePlan, GroupWrapper
from resilient_ckpt.local.replication.strategies import CliqueReplicationStrategy
from resilient_ckpt.testing import launch

from ._local_states import HostOnlyStateDict

pytestmark = pytest.mark.dist

GROUPS = [[0, 2], [1]]


def _lose_directory(path: Path) -> None:
    """A replaced node: the rank's directory is gone. The library's background deleter
    may be unlinking retained files in it at the same moment, hence the retry."""
    while path.exists():
        shutil.rmtree(path, ignore_errors=True)


def _batch(rank: int) -> list[torch.Tensor]:
    """Rank r contributes r tensors of different shapes and dtypes (rank 0: none)."""
    return [
        torch.arange(rank + i + 1, dtype=torch.int64 if i % 2 else torch.float32) * rank
        for i in range(rank)
    ]


def _wrapper_basics(rank: int, mine: GroupWrapper) -> None:
    group = next(g for g in GROUPS if rank in g)
    assert list(mine.ranks) == group and mine.world_size == len(group)
    assert mine.my_global_rank == rank and mine.get_global_rank(mine.my_group_rank) == rank
    assert mine.get_group_rank(rank) == group.index(rank)
    assert mine.backend == "gloo" and torch.device("cpu") in mine.supported_devices
    assert f"global={rank}" in repr(mine)
    world = GroupWrapper()
    assert list(world.ranks) == [0, 1, 2] and world.get_global_rank(2) == 2
    assert world.all_gather_object(rank * 10) == [0, 10, 20]
    gathered = world.all_gather_batch(_batch(rank))
    for r, tensors in enumerate(gathered):
        expected = _batch(r)
        assert len(tensors) == len(expected)
        for got, want in zip(tensors, expected, strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)


def _execute_plan(rank: int, mine: GroupWrapper) -> None:
    if rank == 1:
        return
    plan = ExchangePlan(mine)
    plan.plan(sender=0, receiver=2, id_="a")
    plan.plan(sender=2, receiver=0, id_="b")
    plan.plan(sender=2, receiver=2, id_="c")
    states = {
        "a": {"w": torch.full((3, 2), 1.5), "meta": "from 0"},
        "b": {"w": torch.arange(4), "nested": [torch.ones(2, dtype=torch.bfloat16)]},
        "c": {"w": torch.zeros(1)},
    }
    ids = plan.required_ids()
    assert ids == ({"a"} if rank == 0 else {"b", "c"})
    received = mine.execute_plan(plan, {i: BasicTensorAwareStateDict(states[i]) for i in ids})
    assert set(received) == ({"b"} if rank == 0 else {"a", "c"})
    for id_, state in received.items():
        want = states[id_]
        assert torch.equal(state.state_dict["w"], want["w"])
    if rank == 0:
        assert received["b"].state_dict["nested"][0].dtype == torch.bfloat16
    else:
        assert received["a"].state_dict["meta"] == "from 0"


def _replicated_saves(rank: int, mine: GroupWrapper, root: Path) -> None:
    def manager() -> LocalCheckpointManager:
        return LocalCheckpointManager(root, repl_strategy=CliqueReplicationStrategy(mine))

    group = next(g for g in GROUPS if rank in g)
    whole = HostOnlyStateDict(iteration=1, seed=rank)  # no pop_tensors: saved whole
    expected_whole = whole.clone()
    mgr = manager()
    mgr.save(whole, 1)
    names = {p.name for p in Path(mgr.local_ckpt_dir).iterdir()}
    assert {n for n in names if n.endswith(".pt")} == {f"iter_0000001_{r}_local.pt" for r in group}

    basic = {"w": torch.randn(5, generator=torch.Generator().manual_seed(rank)), "r": rank}
    expected_basic = {"w": basic["w"].clone(), "r": rank}
    request = mgr.save(BasicTensorAwareStateDict(basic), 2, is_async=True)
    basic["w"].add_(1)
    request.execute_sync()

    # Rank 2's node is replaced: its shard comes back from rank 0.
    dist.barrier()
    if rank == 2:
        _lose_directory(Path(mgr.local_ckpt_dir))
    dist.barrier()
    fresh = manager()
    assert fresh.find_latest() == 2
    loaded, ckpt_id = fresh.load()
    assert ckpt_id == (2, rank, "")
    assert torch.equal(loaded.state_dict["w"], expected_basic["w"])
    assert loaded.state_dict["r"] == rank

    # Iteration 1 (saved whole) was removed by retention; save it again elsewhere and lose
    # rank 0's copy this time.
    other = root / "whole"
    mgr = LocalCheckpointManager(other, repl_strategy=CliqueReplicationStrategy(mine))
    mgr.save(HostOnlyStateDict(iteration=1, seed=rank), 1)
    dist.barrier()
    if rank == 0:
        _lose_directory(Path(mgr.local_ckpt_dir))
    dist.barrier()
    fresh = LocalCheckpointManager(other, repl_strategy=CliqueReplicationStrategy(mine))
    assert fresh.find_latest() == 1
    loaded, _ = fresh.load()
    assert loaded.same_values(expected_whole), rank


def _scenarios(rank: int, world_size: int, root: str) -> None:
    groups = [dist.new_group(g) for g in GROUPS]  # collective: every rank creates every group
    mine = GroupWrapper.from_list_of_groups(groups)
    _wrapper_basics(rank, mine)
    _execute_plan(rank, mine)
    _replicated_saves(rank, mine, Path(root))


def test_group_wrapper_and_replication_over_its_groups(tmp_path):
    launch(_scenarios, 3, str(tmp_path), timeout=150)
