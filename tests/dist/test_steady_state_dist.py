"""The DCP steady-state check across ranks: a structure change on one rank only must make
every rank re-plan (no rank may reuse a plan the others abandoned), and each checkpoint
holds every rank's values of its call."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from resilient_ckpt.testing import launch

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

# (what, which rank changes, change, every rank on the steady path)
STEPS = [
    ("first", None, None, False),
    ("values only", None, None, True),
    ("rank 1 reshapes a tensor", 1, "reshape", False),
    ("values only again", None, None, True),
    ("rank 0 adds a tensor", 0, "add", False),
    ("rank 0 changes a non-tensor value", 0, "step", True),
]


def _rank(rank: int, world: int, root: str) -> list:
    from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
    from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
    from resilient_ckpt.async_ckpt.state_dict_saver import (
        CheckpointMetadataCache,
        save_state_dict_async_finalize,
        save_state_dict_async_plan,
    )

    warnings.filterwarnings("ignore")
    set_ups: list = []
    original = DefaultSavePlanner.set_up_planner

    def counting(self, *args, **kwargs):
        set_ups.append(1)
        return original(self, *args, **kwargs)

    DefaultSavePlanner.set_up_planner = counting  # type: ignore[method-assign]
    state: dict = {f"r{rank}.w{i}": torch.full((5 + i,), float(rank)) for i in range(6)}
    state[f"r{rank}.step"] = 0
    cache = CheckpointMetadataCache()
    queue = AsyncCallsQueue()
    out = []
    try:
        for n, (_what, who, change, _steady) in enumerate(STEPS):
            if who == rank and change == "reshape":
                state[f"r{rank}.w2"] = torch.full((3, 3), 9.0)
            elif who == rank and change == "add":
                state[f"r{rank}.extra"] = torch.full((4,), 4.0)
            elif who == rank and change == "step":
                state[f"r{rank}.step"] = 42
            for value in state.values():
                if torch.is_tensor(value):
                    value.add_(1)
            expected = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
            before = len(set_ups)
            writer = FileSystemWriterAsync(os.path.join(root, f"s{n}"), thread_count=1)
            ret = save_state_dict_async_plan(state, writer, enable_cache=True, metadata_cache=cache)
            steady = len(set_ups) == before
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
            target = {
                k: torch.zeros_like(v) if torch.is_tensor(v) else None for k, v in expected.items()
            }
            dcp.load(target, checkpoint_id=os.path.join(root, f"s{n}"))
            same = all(
                torch.equal(target[k], v) if torch.is_tensor(v) else target[k] == v
                for k, v in expected.items()
            )
            out.append((steady, same))
    finally:
        queue.close()
    return out


def test_one_rank_changing_its_structure_makes_every_rank_replan(tmp_path) -> None:
    results = launch(_rank, 2, str(tmp_path))
    for rank, rows in enumerate(results):
        for (what, _who, _change, steady), (was_steady, same) in zip(STEPS, rows, strict=True):
            assert same, f"rank {rank}, {what}: checkpoint does not hold the call's values"
            assert was_steady == steady, f"rank {rank}, {what}: steady {was_steady}"
