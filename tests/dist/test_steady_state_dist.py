"""The DCP steady state across ranks: after a structure change on one rank only, and on
the saves after it, each checkpoint holds every rank's values of its call, as every rank
loads them; a planner with its own set-up has it run at every save. (That every rank
re-plans, and that a steady save plans nothing, is the performance contract,
``tests/unit/test_performance_contract.py``.)"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from resilient_ckpt.testing import launch

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

# (what, which rank changes, change)
STEPS = [
    ("first", None, None),
    ("values only", None, None),
    ("rank 1 reshapes a tensor", 1, "reshape"),
    ("values only again", None, None),
    ("rank 0 adds a tensor", 0, "add"),
    ("rank 0 changes a non-tensor value", 0, "step"),
]


def _rank(rank: int, world: int, root: str) -> list:
    import torch.distributed as dist

    from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
    from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
    from resilient_ckpt.async_ckpt.state_dict_saver import (
        CheckpointMetadataCache,
        save_state_dict_async_finalize,
        save_state_dict_async_plan,
    )

    warnings.filterwarnings("ignore")
    state: dict = {f"r{rank}.w{i}": torch.full((5 + i,), float(rank)) for i in range(6)}
    state[f"r{rank}.step"] = 0
    cache = CheckpointMetadataCache()
    queue = AsyncCallsQueue()
    out = []
    try:
        for n, (_what, who, change) in enumerate(STEPS):
            if who == rank and change == "reshape":
                state[f"r{rank}.w2"] = torch.full((3, 3), 9.0)
            elif who == rank and change == "add":
                state[f"r{rank}.extra"] = torch.full((4,), 4.0)
            elif who == rank and change == "step":
                state[f"r{rank}.step"] = 42
            for value in state.values():
                if torch.is_tensor(value):
                    value.add_(1)
            mine = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
            writer = FileSystemWriterAsync(os.path.join(root, f"s{n}"), thread_count=1)
            ret = save_state_dict_async_plan(state, writer, enable_cache=True, metadata_cache=cache)
            save_fn, preload_fn, args = writer.get_save_function_and_args()
            request = AsyncRequest(
                save_fn,
                args,
                [lambda r=ret: save_state_dict_async_finalize(*r)],
                preload_fn=preload_fn,
            )
            queue.schedule_async_request(request)
            for value in state.values():
                if torch.is_tensor(value):
                    value.add_(1000)  # after the call: not in the checkpoint
            queue.maybe_finalize_async_calls(blocking=True)
            for value in state.values():
                if torch.is_tensor(value):
                    value.sub_(1000)
            every: list = [None] * world
            dist.all_gather_object(every, mine)  # every rank's entries of this save
            expected = {k: v for part in every for k, v in part.items()}
            target = {
                k: torch.zeros_like(v) if torch.is_tensor(v) else None for k, v in expected.items()
            }
            dcp.load(target, checkpoint_id=os.path.join(root, f"s{n}"))
            same = all(
                torch.equal(target[k], v) if torch.is_tensor(v) else target[k] == v
                for k, v in expected.items()
            )
            out.append(same)
    finally:
        queue.close()
    return out


def test_one_rank_changing_its_structure_is_saved_right_for_every_rank(tmp_path) -> None:
    results = launch(_rank, 2, str(tmp_path))
    for rank, rows in enumerate(results):
        for (what, _who, _change), same in zip(STEPS, rows, strict=True):
            assert same, f"rank {rank}, {what}: checkpoint does not hold every rank's values"


# -- a ShardedTensor state and a planner with its own set-up (Megatron-LM's kind) -------------

# (what, change, every rank reuses the cached plan: the performance contract checks it)
SHARDED_STEPS = [
    ("first", None, False),
    ("values only", None, True),
    ("every rank's shard grows a row", "reshard", False),
    ("values only again", None, True),
    ("rank 0 adds a tensor", "add", False),
    ("a non-tensor value", "step", True),
]


class OwnSetUpPlanner(DefaultSavePlanner):
    """A planner with its own set-up (Megatron-LM's kind): a reused plan still runs it."""

    set_ups = 0

    def set_up_planner(self, *args, **kwargs):
        OwnSetUpPlanner.set_ups += 1
        return super().set_up_planner(*args, **kwargs)


def _sharded(rank: int, world: int, rows: int, value: float):
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    local = torch.full((rows, 4), value)
    placement = f"rank:{rank}/cpu"
    metadata = ShardMetadata([rank * rows, 0], [rows, 4], placement)
    return init_from_local_shards([Shard(local, metadata)], world * rows, 4)


def _sharded_rank(rank: int, world: int, root: str) -> list:
    from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
    from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
    from resilient_ckpt.async_ckpt.state_dict_saver import (
        CheckpointMetadataCache,
        save_state_dict_async_finalize,
        save_state_dict_async_plan,
    )

    warnings.filterwarnings("ignore")
    rows = 2
    state: dict = {"st": _sharded(rank, world, rows, float(rank)), f"r{rank}.w": torch.ones(3)}
    state["step"] = 0
    cache = CheckpointMetadataCache()
    queue = AsyncCallsQueue()
    out = []
    try:
        for n, (_what, change, _reused) in enumerate(SHARDED_STEPS):
            if change == "reshard":
                rows += 1
                state["st"] = _sharded(rank, world, rows, float(rank))
            elif change == "add" and rank == 0:
                state["r0.extra"] = torch.full((4,), 4.0)
            elif change == "step":
                state["step"] = 42
            state["st"].local_shards()[0].tensor.add_(n)
            state[f"r{rank}.w"].add_(n)
            expected = state["st"].local_shards()[0].tensor.clone()
            set_ups = OwnSetUpPlanner.set_ups
            writer = FileSystemWriterAsync(os.path.join(root, f"s{n}"), thread_count=1)
            ret = save_state_dict_async_plan(
                state, writer, planner=OwnSetUpPlanner(), enable_cache=True, metadata_cache=cache
            )
            set_up = OwnSetUpPlanner.set_ups == set_ups + 1
            save_fn, preload_fn, args = writer.get_save_function_and_args()
            finalize = [lambda r=ret: save_state_dict_async_finalize(*r)]
            queue.schedule_async_request(
                AsyncRequest(save_fn, args, finalize, preload_fn=preload_fn)
            )
            queue.maybe_finalize_async_calls(blocking=True)
            target = {"st": _sharded(rank, world, rows, -1.0), "step": None}
            dcp.load(target, checkpoint_id=os.path.join(root, f"s{n}"))
            loaded = target["st"].local_shards()[0].tensor
            out.append((set_up, torch.equal(loaded, expected), target["step"]))
    finally:
        queue.close()
    return out


def test_sharded_tensors_and_an_own_planner_save_every_change(tmp_path) -> None:
    """ShardedTensors (as Megatron-LM's torch_dist states hold), saved through the plan
    cache with a planner that has its own set-up: unchanged, resharded, or changed on one
    rank, each checkpoint holds its call's shards, and the planner's set-up runs once per
    save."""
    results = launch(_sharded_rank, 2, str(tmp_path))
    for rank, rows in enumerate(results):
        for (what, change, _reused), (set_up, same, step) in zip(SHARDED_STEPS, rows, strict=True):
            assert set_up, f"rank {rank}, {what}: the planner's own set-up did not run once"
            assert same, f"rank {rank}, {what}: the shard does not hold the call's values"
            assert step == (42 if change == "step" else 0), f"rank {rank}, {what}: step {step}"
