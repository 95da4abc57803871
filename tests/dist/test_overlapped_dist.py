"""Overlapped staging across ranks (issue 13, goal 2): every rank schedules an async DCP save
with ``overlap_staging=True``, waits for its snapshot, then changes every tensor (the
"optimizer step") while the copies and writes may still run; the cross-rank finalize commits
one checkpoint that holds, on every rank, the values of the call. The same for
``TorchAsyncCheckpoint`` per rank. Several rounds reuse the staged structure."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from resilient_ckpt.async_ckpt.state_dict_saver import (
    CheckpointMetadataCache,
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from resilient_ckpt.async_ckpt.torch_ckpt import TorchAsyncCheckpoint
from resilient_ckpt.testing import launch

pytestmark = [pytest.mark.dist]


def _state(rank: int) -> dict:
    gen = torch.Generator().manual_seed(rank)
    layers = {f"rank{rank}.layer{i}": torch.randn(257 * (i + 1), generator=gen) for i in range(40)}
    layers[f"rank{rank}.big"] = torch.randn(1 << 20, generator=gen)  # 4 MiB
    return {"model": layers, "step": 0}


def _snapshot(state: dict) -> dict:
    return {"model": {k: v.clone() for k, v in state["model"].items()}, "step": state["step"]}


def _step(state: dict) -> None:
    for tensor in state["model"].values():
        tensor.mul_(-1).add_(3)
    state["step"] += 1


def _job(rank: int, world: int, root: str) -> list[bool]:
    warnings.filterwarnings("ignore")
    state = _state(rank)
    queue = AsyncCallsQueue()
    cache = CheckpointMetadataCache()
    torch_ckpt = TorchAsyncCheckpoint()
    results = []
    try:
        for round_ in range(3):
            expected = _snapshot(state)
            path = os.path.join(root, f"dcp{round_}")
            writer = FileSystemWriterAsync(path, thread_count=2)
            plan_ret = save_state_dict_async_plan(
                state, writer, enable_cache=True, metadata_cache=cache
            )
            save_fn, preload_fn, args = writer.get_save_function_and_args()
            finalize = [lambda plan_ret=plan_ret: save_state_dict_async_finalize(*plan_ret)]
            request = AsyncRequest(save_fn, args, finalize, preload_fn=preload_fn)
            queue.schedule_async_request(request, overlap_staging=True)
            pt_path = os.path.join(root, f"rank{rank}_{round_}.pt")
            torch_ckpt.async_save(state, pt_path, overlap_staging=True)
            queue.wait_for_snapshot()
            torch_ckpt.wait_for_snapshot()
            _step(state)  # while the writes may still be running
            queue.maybe_finalize_async_calls(blocking=True)
            torch_ckpt.finalize_async_save(blocking=True)

            target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
            target["step"] = -1
            dcp.load(target, checkpoint_id=path)
            saved = torch.load(pt_path)
            results.append(
                target["step"] == expected["step"] == saved["step"]
                and all(torch.equal(target["model"][k], v) for k, v in expected["model"].items())
                and all(torch.equal(saved["model"][k], v) for k, v in expected["model"].items())
            )
    finally:
        torch_ckpt.close()
        queue.close()
    return results


@pytest.mark.timeout(240)
def test_overlapped_saves_hold_the_values_of_the_call_on_every_rank(tmp_path) -> None:
    results = launch(_job, 2, str(tmp_path), timeout=200)
    assert results == [[True, True, True], [True, True, True]]


def _save_pt(path: str, state: dict) -> None:
    torch.save(state, path)


def _one_rank_cannot_stage(rank: int, world: int, root: str) -> tuple[str, str]:
    import threading

    queue = AsyncCallsQueue()
    try:
        state: dict = {"w": torch.full((16,), float(rank))}
        if rank == 1:
            state["lock"] = threading.Lock()  # cannot be pickled: its staging fails
        path = os.path.join(root, f"r{rank}.pt")
        queue.schedule_async_request(
            AsyncRequest(_save_pt, (path, state), []), overlap_staging=True
        )
        try:
            queue.maybe_finalize_async_calls(blocking=True)
        except Exception as exc:
            failed = (type(exc).__name__, str(exc))
        else:
            failed = ("", "")
        # The queue goes on: the next save, staged fine everywhere, completes everywhere.
        state.pop("lock", None)
        queue.schedule_async_request(
            AsyncRequest(_save_pt, (path, state), []), overlap_staging=True
        )
        queue.maybe_finalize_async_calls(blocking=True)
        return failed
    finally:
        queue.close()


@pytest.mark.timeout(180)
def test_a_staging_failure_on_one_rank_is_an_error_on_every_rank(tmp_path) -> None:
    for rank, (kind, message) in enumerate(launch(_one_rank_cannot_stage, 2, str(tmp_path))):
        assert kind, f"rank {rank}: finalizing did not report rank 1's failed staging"
        assert "rank(s) [1]" in message and "cannot be sent" in message, (rank, message)
