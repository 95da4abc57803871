"""Cross-rank behaviour of the async core on gloo (2 and 4 ranks)."""

from __future__ import annotations

import functools
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from resilient_ckpt import _dist
from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from resilient_ckpt.config import Timeouts
from resilient_ckpt.errors import AsyncCallFailedError, RemoteTraceback, WorkerDiedError
from resilient_ckpt.testing import launch
from tests import _helpers

pytestmark = pytest.mark.dist

FAST = Timeouts(worker_start=90, finalize=30, collective=60, shutdown=10, poll_interval=0.02)


def _completion_and_fifo(rank: int, world: int, tmpdir: str, persistent: bool) -> dict:
    queue = AsyncCallsQueue(persistent=persistent, timeouts=FAST)
    finalized: list[int] = []
    state = {"w": torch.full((1000,), float(rank))}
    for i in range(3):
        path = os.path.join(tmpdir, f"r{rank}_{i}.pt")
        req = AsyncRequest(_helpers.write_tensors, (path, state), [])
        req.add_finalize_fn(functools.partial(finalized.append, i))
        queue.schedule_async_request(req)
        state["w"].add_(100)  # mutate right after scheduling
    idxs = queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    values = [float(torch.load(os.path.join(tmpdir, f"r{rank}_{i}.pt"))["w"][0]) for i in range(3)]
    group = _dist.library_group(FAST.collective)
    backend = dist.get_backend(group)
    queue.close()
    return {"idxs": idxs, "finalized": finalized, "values": values, "backend": backend}


@pytest.mark.parametrize("world, persistent", [(2, True), (4, True), (2, False)])
def test_cross_rank_completion_fifo_and_snapshot(tmp_path, world, persistent) -> None:
    results = launch(_completion_and_fifo, world, str(tmp_path), persistent, timeout=150)
    for rank, res in enumerate(results):
        assert res["idxs"] == [0, 1, 2]
        assert res["finalized"] == [0, 1, 2]
        assert res["values"] == [rank + 100.0 * i for i in range(3)]
        assert res["backend"] == "gloo"


def _one_rank_fails(rank: int, world: int, tmpdir: str) -> dict:
    queue = AsyncCallsQueue(timeouts=FAST)
    ran: list[int] = []
    req = AsyncRequest(
        _helpers.fail_on_rank,
        (1, rank, os.path.join(tmpdir, f"{rank}.pt"), {"x": torch.ones(2)}),
        [],
    )
    req.add_finalize_fn(functools.partial(ran.append, 1))
    queue.schedule_async_request(req)
    try:
        queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
        outcome: dict = {"raised": None}
    except AsyncCallFailedError as exc:
        cause = exc.__cause__
        while cause is not None and not isinstance(cause, RemoteTraceback):
            cause = cause.__cause__
        outcome = {
            "raised": str(exc),
            "ranks": list(exc.failed_ranks),
            "tb": cause.tb if cause is not None else "",
        }
    outcome["finalized"] = ran
    # the queue and the collectives stay in step after a failure
    queue.schedule_async_request(AsyncRequest(_helpers.return_none, (), []))
    outcome["after"] = queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    queue.close()
    return outcome


def test_exception_on_one_rank_raises_on_every_rank(tmp_path) -> None:
    for res in launch(_one_rank_fails, 4, str(tmp_path), timeout=150):
        assert res["raised"] is not None and "rank(s) [1]" in res["raised"]
        assert res["ranks"] == [1]
        assert "injected failure on rank 1" in res["tb"] and "fail_on_rank" in res["tb"]
        assert res["finalized"] == []
        assert res["after"] == [1]


def _worker_killed_on_rank1(rank: int, world: int, tmpdir: str, blocking: bool) -> dict:
    queue = AsyncCallsQueue(timeouts=FAST)
    marker = os.path.join(tmpdir, f"pid{rank}")
    delay = 60 if rank == 1 else 0.1
    queue.schedule_async_request(
        AsyncRequest(
            _helpers.write_after_marker, (os.path.join(tmpdir, f"{rank}.pt"), {}, marker, delay), []
        )
    )
    if rank == 1:
        os.kill(int(_helpers.wait_for_file(marker)), signal.SIGKILL)
    started = time.monotonic()
    try:
        while time.monotonic() - started < 40:
            queue.maybe_finalize_async_calls(blocking=blocking, no_dist=False)
            time.sleep(0.05)
        outcome: dict = {"raised": None}
    except WorkerDiedError as exc:
        outcome = {"raised": str(exc), "exitcode": exc.exitcode}
    outcome["seconds"] = time.monotonic() - started
    queue.close()
    return outcome


@pytest.mark.parametrize("blocking", [True, False])
def test_worker_sigkill_raises_on_every_rank_within_30s(tmp_path, blocking) -> None:
    for res in launch(_worker_killed_on_rank1, 2, str(tmp_path), blocking, timeout=150):
        assert res["raised"] is not None, "a dead worker must be an error on every rank"
        assert "rank 1" in res["raised"] and "SIGKILL" in res["raised"]
        assert res["exitcode"] == -signal.SIGKILL
        assert res["seconds"] < 30
