"""Deferred DCP planning across ranks (``save_state_dict_async_plan(..., defer_planning=True)``):
from the second save on, the planning runs on the staging thread, not in the plan call
(overlapped or not: the trainer waits for it when not); a structure change on one rank
is saved right by every rank (each rank loads every rank's tensors of each checkpoint,
with the shapes of its call); a
planning failure on one rank is an error on every rank where the snapshot is waited for,
and the next save works."""

from __future__ import annotations

import os
import threading
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from resilient_ckpt.testing import launch

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

STAGER = "resilient_ckpt-stage"  # the staging thread's name prefix

# (what, which rank changes its structure, how, overlapped staging)
ROUNDS = [
    ("first save: plans in the call", None, None, True),
    ("values only", None, None, True),
    ("rank 1 reshapes a tensor", 1, "reshape", True),
    ("values only, staged in the call", None, None, False),
    ("rank 0 adds a tensor", 0, "add", True),
    ("values only", None, None, True),
]


def _state(rank: int) -> dict:
    gen = torch.Generator().manual_seed(rank)
    model = {f"rank{rank}.w{i}": torch.randn(64 + 8 * i, generator=gen) for i in range(30)}
    return {"model": model, "step": 0}


def _change(state: dict, rank: int, how: str | None) -> None:
    if how == "reshape":
        state["model"][f"rank{rank}.w3"] = torch.randn(5, 7)
    elif how == "add":
        state["model"][f"rank{rank}.extra"] = torch.arange(11.0)


def _save(state, path, queue, cache, overlap, planned_on=()):
    """Save through the queue; the threads the plan call planned on."""
    from resilient_ckpt.async_ckpt.core import AsyncRequest
    from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
    from resilient_ckpt.async_ckpt.state_dict_saver import (
        save_state_dict_async_finalize,
        save_state_dict_async_plan,
    )

    writer = FileSystemWriterAsync(path, thread_count=2)
    ret = save_state_dict_async_plan(
        state, writer, enable_cache=True, metadata_cache=cache, defer_planning=True
    )
    in_call = list(planned_on)
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    finalize = [lambda: save_state_dict_async_finalize(*ret)]
    queue.schedule_async_request(
        AsyncRequest(save_fn, args, finalize, preload_fn=preload_fn), overlap_staging=overlap
    )
    return in_call


def _rounds(rank: int, world: int, root: str) -> list:
    import torch.distributed as dist

    from resilient_ckpt.async_ckpt import state_dict_saver
    from resilient_ckpt.async_ckpt.core import AsyncCallsQueue
    from resilient_ckpt.async_ckpt.state_dict_saver import CheckpointMetadataCache

    warnings.filterwarnings("ignore")
    planned_on: list[str] = []
    real_plan = state_dict_saver._plan

    def recording_plan(*args, **kwargs):
        planned_on.append(threading.current_thread().name)
        return real_plan(*args, **kwargs)

    state_dict_saver._plan = recording_plan
    state = _state(rank)
    queue = AsyncCallsQueue()
    cache = CheckpointMetadataCache()
    out = []
    try:
        for k, (_, who, how, overlap) in enumerate(ROUNDS):
            if who == rank:
                _change(state, rank, how)
            planned_on.clear()
            path = os.path.join(root, f"ckpt{k}")
            planned_in_call = _save(state, path, queue, cache, overlap, planned_on)
            queue.wait_for_snapshot()
            mine = {key: t.clone() for key, t in state["model"].items()}
            for tensor in state["model"].values():  # the "optimizer step"
                tensor.mul_(-2).add_(1)
            queue.maybe_finalize_async_calls(blocking=True)
            every: list = [None] * world
            dist.all_gather_object(every, mine)  # every rank's tensors of this save
            expected = {key: t for part in every for key, t in part.items()}
            target = {"model": {key: torch.zeros_like(t) for key, t in expected.items()}}
            target["step"] = -1
            dcp.load(target, checkpoint_id=path)
            exact = all(torch.equal(target["model"][key], t) for key, t in expected.items())
            out.append((planned_in_call, list(planned_on), exact))
    finally:
        queue.close()
    return out


def test_deferred_planning_runs_at_staging_and_replans_on_any_rank_change(tmp_path) -> None:
    main = threading.main_thread().name
    results = launch(_rounds, 2, str(tmp_path), timeout=160)
    for rank, rounds in enumerate(results):
        for (what, who, _, _), got in zip(ROUNDS, rounds, strict=True):
            in_call, all_plans, exact = got
            where = f"rank {rank}, {what}"
            assert exact, f"{where}: the checkpoint does not hold every rank's values"
            if who is None and what.startswith("first"):
                assert in_call == [main], (where, got)
                continue
            assert in_call == [], (where, got)  # nothing planned in the call
            # On the staging thread, overlapped or not (the trainer waits for it when not).
            assert len(all_plans) == 1 and all_plans[0].startswith(STAGER), (where, got)


def _one_rank_fails_planning(rank: int, world: int, root: str) -> list:
    from resilient_ckpt.async_ckpt.core import AsyncCallsQueue
    from resilient_ckpt.async_ckpt.state_dict_saver import CheckpointMetadataCache
    from resilient_ckpt.errors import RankFailureError

    warnings.filterwarnings("ignore")
    state = _state(rank)
    queue = AsyncCallsQueue()
    cache = CheckpointMetadataCache()
    out = []
    try:
        _save(state, os.path.join(root, "a"), queue, cache, True)
        queue.wait_for_snapshot()
        queue.maybe_finalize_async_calls(blocking=True)
        for overlap in (True, False):
            if rank == 1:
                state[7] = torch.zeros(3)  # a top-level key DCP cannot load back: refused
            try:
                _save(state, os.path.join(root, f"bad{overlap}"), queue, cache, overlap)
                queue.wait_for_snapshot()
                queue.maybe_finalize_async_calls(blocking=True)
            except RankFailureError as exc:  # RankConfigurationError here
                out.append((type(exc).__name__, str(exc)))
            else:
                out.append(("", ""))
            # A request whose planning failed on the staging thread was scheduled: the
            # queue's next finalize reports it (once: the save after it finalizes cleanly).
            # One that failed in the call was never scheduled: nothing is left to report.
            try:
                queue.maybe_finalize_async_calls(blocking=True)
            except RankFailureError as exc:
                out.append((type(exc).__name__, str(exc)))
            else:
                out.append(("", queue.get_num_unfinalized_calls()))
            state.pop(7, None)
            _save(state, os.path.join(root, f"good{overlap}"), queue, cache, True)
            queue.wait_for_snapshot()
            queue.maybe_finalize_async_calls(blocking=True)
            target = {"model": {key: torch.zeros_like(t) for key, t in state["model"].items()}}
            target["step"] = -1
            dcp.load(target, checkpoint_id=os.path.join(root, f"good{overlap}"))
            out.append(all(torch.equal(target["model"][k], t) for k, t in state["model"].items()))
    finally:
        queue.close()
    return out


def test_a_deferred_planning_failure_on_one_rank_is_an_error_on_every_rank(tmp_path) -> None:
    results = launch(_one_rank_fails_planning, 2, str(tmp_path), timeout=160)
    for rank, (overlapped, again1, good1, in_call, again2, good2) in enumerate(results):
        for mode, (kind, message) in (("overlapped", overlapped), ("in the call", in_call)):
            assert kind == "RankConfigurationError", (rank, mode, kind)
            assert "rank(s) [1]" in message and "string keys" in message, (rank, mode, message)
        kind, message = again1  # the overlapped request, reported by the finalize
        assert kind == "RankConfigurationError", (rank, again1)
        assert message.startswith("async request 1 failed") and "string keys" in message
        assert again2 == ("", 0), (rank, again2)  # the call's failure scheduled nothing
        assert good1 is True and good2 is True, (rank, results)
