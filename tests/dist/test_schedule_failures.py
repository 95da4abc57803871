"""A bad value in the state is every rank's error, in every flow, and the next save works.

Each rank runs the same loop: a good save, a save whose state holds a lambda (on every rank,
or on rank 1 only), a finalize, a good save, a blocking finalize. Every rank catches what it
raises and carries on, as a trainer that logs a failed checkpoint and keeps training would.
The failed step must raise a package error on every rank (naming rank 1 and the key where
only rank 1 has the bad value), nothing may be committed for it (with ``torch.save``, whose
files are each rank's own, nothing by the failing rank), no rank may hang or abort, and the
next save must commit and load bit-exact.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from resilient_ckpt.async_ckpt.state_dict_saver import (
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from resilient_ckpt.async_ckpt.torch_ckpt import TorchAsyncCheckpoint
from resilient_ckpt.config import Timeouts
from resilient_ckpt.errors import CheckpointingException
from resilient_ckpt.local import BasicTensorAwareStateDict, LocalCheckpointManager
from resilient_ckpt.testing import launch
from resilient_ckpt.tiered import TieredCheckpointManager

pytestmark = pytest.mark.dist

FAST = Timeouts(worker_start=90, finalize=30, collective=30, shutdown=10, poll_interval=0.02)


class Refusing:
    """A value whose pickling fails when ``refuse`` is set: the same structure either way, so
    a save with it set finds its plan cached."""

    def __init__(self, refuse: bool) -> None:
        self.refuse = refuse

    def __reduce__(self) -> Any:
        if self.refuse:
            raise TypeError("this value refuses to be pickled")
        return (Refusing, (False,))


def _state(rank: int, step: int, bad: bool, cached: bool = False) -> dict[str, Any]:
    state: dict[str, Any] = {
        "w": torch.arange(64, dtype=torch.float32) + 1000 * step + rank,
        "step": step,
    }
    if cached:
        state["hook"] = Refusing(bad)
    elif bad:
        state["hook"] = lambda: step
    return state


def _attempt(errors: list[str], fn: Callable[[], Any]) -> Any:
    """Run ``fn``; a package error is recorded (and the loop goes on), anything else fails."""
    try:
        return fn()
    except CheckpointingException as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
        return None


def _dcp_flow(rank: int, root: str, bad: Callable[[int], bool], cached: bool = False) -> dict:
    queue = AsyncCallsQueue(timeouts=FAST)

    def save(step: int) -> None:
        writer = FileSystemWriterAsync(os.path.join(root, f"iter_{step}"), thread_count=1)
        state = _state(rank, step, bad(step), cached)
        plan = save_state_dict_async_plan(state, writer, enable_cache=True)
        save_fn, preload_fn, args = writer.get_save_function_and_args()
        commit = [lambda: save_state_dict_async_finalize(*plan)]
        queue.schedule_async_request(AsyncRequest(save_fn, args, commit, preload_fn=preload_fn))

    def finalize(blocking: bool) -> None:
        queue.maybe_finalize_async_calls(blocking=blocking, no_dist=False)

    errors = _run(save, finalize)
    queue.close()
    loaded: dict[str, Any] = {"w": torch.zeros(64), "step": -1}
    if cached:
        loaded["hook"] = None
    dcp.load(loaded, checkpoint_id=os.path.join(root, "iter_3"))
    committed = sorted(
        s for s in (1, 2, 3) if os.path.exists(os.path.join(root, f"iter_{s}", ".metadata"))
    )
    return {"errors": errors, "committed": committed, "loaded": (loaded["w"], loaded["step"])}


def _torch_flow(rank: int, root: str, bad: Callable[[int], bool]) -> dict:
    ckpt = TorchAsyncCheckpoint(timeouts=FAST)

    def save(step: int) -> None:
        ckpt.async_save(_state(rank, step, bad(step)), os.path.join(root, f"r{rank}_{step}.pt"))

    def finalize(blocking: bool) -> None:
        ckpt.finalize_async_save(blocking=blocking, no_dist=False)

    errors = _run(save, finalize)
    ckpt.close()
    committed = sorted(
        s for s in (1, 2, 3) if os.path.exists(os.path.join(root, f"r{rank}_{s}.pt"))
    )
    loaded = torch.load(os.path.join(root, f"r{rank}_3.pt"))
    return {"errors": errors, "committed": committed, "loaded": (loaded["w"], loaded["step"])}


def _tiered_flow(rank: int, root: str, bad: Callable[[int], bool]) -> dict:
    mgr = TieredCheckpointManager(
        os.path.join(root, "memory"),
        os.path.join(root, "durable"),
        replication_factor=2,
        replication_jump=1,
        durable_every=1,
        timeouts=FAST,
    )

    def save(step: int) -> None:
        mgr.save(_state(rank, step, bad(step)), step)

    errors = _run(save, lambda blocking: mgr.maybe_finalize(blocking=blocking))
    mgr.close()
    committed = sorted(
        s
        for s in (1, 2, 3)
        if os.path.exists(os.path.join(root, "durable", f"step_{s:09d}", ".metadata"))
    )
    fresh = TieredCheckpointManager(
        os.path.join(root, "memory"),
        os.path.join(root, "durable"),
        replication_factor=2,
        replication_jump=1,
        timeouts=FAST,
    )
    loaded = {"w": torch.zeros(64), "step": -1}
    step = fresh.load(loaded)
    fresh.close()
    assert step == 3, step
    return {"errors": errors, "committed": committed, "loaded": (loaded["w"], loaded["step"])}


def _local_flow(rank: int, root: str, bad: Callable[[int], bool]) -> dict:
    mgr = LocalCheckpointManager(root, session_id="s")
    queue = AsyncCallsQueue(timeouts=FAST)

    def save(step: int) -> None:
        state = BasicTensorAwareStateDict(_state(rank, step, bad(step)))
        queue.schedule_async_request(mgr.save(state, step, is_async=True))

    def finalize(blocking: bool) -> None:
        queue.maybe_finalize_async_calls(blocking=blocking, no_dist=False)

    errors = _run(save, finalize)
    queue.close()
    committed = [mgr.find_latest()]
    state, _ = mgr.load()
    loaded = state.state_dict
    return {"errors": errors, "committed": committed, "loaded": (loaded["w"], loaded["step"])}


def _run(save: Callable[[int], None], finalize: Callable[[bool], None]) -> list[str]:
    errors: list[str] = []
    for step in (1, 2, 3):
        _attempt(errors, lambda: finalize(False))
        _attempt(errors, lambda s=step: save(s))  # type: ignore[misc]
        time.sleep(0.2)
    _attempt(errors, lambda: finalize(True))
    return errors


_FLOWS = {"dcp": _dcp_flow, "torch": _torch_flow, "tiered": _tiered_flow, "local": _local_flow}


def _job(rank: int, world: int, root: str, flow: str, where: str) -> dict:
    def bad(step: int) -> bool:
        return step == 2 and (where == "every" or rank == 1)

    started = time.monotonic()
    if where == "cached":
        result = _dcp_flow(rank, root, bad, cached=True)
    else:
        result = _FLOWS[flow](rank, root, bad)
    dist.barrier()
    result["seconds"] = time.monotonic() - started
    w, step = result["loaded"]
    result["loaded"] = (w.tolist(), step)  # tensors would cross the launcher's pipe as fds
    return result


@pytest.mark.timeout(240)
@pytest.mark.parametrize("where", ["every", "one"])
@pytest.mark.parametrize("flow", sorted(_FLOWS))
def test_bad_value_fails_every_rank_and_the_next_save_commits(tmp_path, flow, where) -> None:
    results = launch(_job, 2, str(tmp_path), flow, where, timeout=200)
    for rank, result in enumerate(results):
        errors = result["errors"]
        assert errors, f"rank {rank} raised nothing for the bad save ({flow}, {where})"
        text = "\n".join(errors)
        assert "hook" in text and "function" in text, text
        if where == "one":
            assert "rank" in text and "1" in text, text
        if flow == "local":
            assert result["committed"] == [3]
        elif flow == "torch":
            # Each rank's file is its own commit: a rank whose save succeeded keeps its file.
            assert result["committed"] == ([1, 3] if where == "every" or rank == 1 else [1, 2, 3])
        else:
            assert 2 not in result["committed"], (rank, result["committed"])
            assert 3 in result["committed"], (rank, result["committed"])
        values, step = result["loaded"]
        w = torch.tensor(values)
        assert step == 3
        expected_rank = rank if flow in ("torch", "local") else int(w[0].item()) - 3000
        assert expected_rank in (0, 1), w[:2]
        assert torch.equal(w, torch.arange(64, dtype=torch.float32) + 3000 + expected_rank)
        assert result["seconds"] < 120, result["seconds"]


@pytest.mark.timeout(120)
def test_bad_value_with_a_cached_plan_fails_every_rank(tmp_path) -> None:
    """The plan cache's one agreement carries the failure: rank 1's value fails to pickle in
    a save whose plan is cached (the structure is that of the save before)."""
    results = launch(_job, 2, str(tmp_path), "dcp", "cached", timeout=100)
    for result in results:
        text = "\n".join(result["errors"])
        assert "plan cache check" in text and "rank(s) [1]" in text, text
        assert "state['hook'] (a Refusing)" in text, text
        assert result["committed"] == [1, 3], result["committed"]
