"""Reports (``async_ckpt._reports``): what background code sends the trainer while it runs,
over the worker's channel, a forked child's pipe, or directly in the trainer."""

from __future__ import annotations

import os
import threading
import time
import uuid

import pytest

from resilient_ckpt.async_ckpt import _reports
from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from resilient_ckpt.config import Timeouts
from resilient_ckpt.errors import CheckpointTimeoutError, CheckpointWriteError

FAST = Timeouts(worker_start=90, finalize=30, collective=60, shutdown=10, poll_interval=0.02)

pytestmark = pytest.mark.timeout(120)


def _post_then_wait(key: str, value: object, release: str) -> None:
    """Background function: post a report, then go on working until ``release`` exists."""
    _reports.post(key, value)
    deadline = time.monotonic() + 30
    while not os.path.exists(release):
        if time.monotonic() > deadline:
            raise TimeoutError("the trainer never took the report")
        time.sleep(0.01)


def test_a_worker_report_is_taken_while_its_call_runs_without_polling_the_queue(
    tmp_path,
) -> None:
    """As the tiered manager's replicator thread does: the call is still running and
    nobody polls the queue; take() reads the worker's channel itself."""
    key = uuid.uuid4().hex
    release = str(tmp_path / "release")
    queue = AsyncCallsQueue(timeouts=FAST)
    try:
        queue.schedule_async_request(
            AsyncRequest(_post_then_wait, (key, {"files": 3}, release), [])
        )
        taken: list[object] = []
        thread = threading.Thread(
            target=lambda: taken.append(_reports.take(key, rank=0, what="w", timeout=60))
        )
        thread.start()
        thread.join(60)
        assert taken == [{"files": 3}]
        assert queue.get_num_unfinalized_calls() == 1  # the call was still running
        open(release, "w").close()
        assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    finally:
        queue.close()


def test_a_forked_child_sends_a_report_larger_than_its_pipe(tmp_path) -> None:
    key = uuid.uuid4().hex
    release = str(tmp_path / "release")
    open(release, "w").close()
    big = os.urandom(4 << 20)  # far beyond a pipe's buffer: the trainer must read meanwhile
    queue = AsyncCallsQueue(persistent=False, timeouts=FAST)
    try:
        queue.schedule_async_request(AsyncRequest(_post_then_wait, (key, big, release), []))
        assert queue.maybe_finalize_async_calls(blocking=True) == [0]
        assert _reports.take(key, rank=0, what="w") == big
    finally:
        queue.close()


def test_a_missing_report_is_a_named_error() -> None:
    with pytest.raises(CheckpointWriteError, match="rank 3: the write to x ended without"):
        _reports.take("never-posted", rank=3, what="the write to x")
    ended = threading.Event()
    threading.Timer(0.2, ended.set).start()
    with pytest.raises(CheckpointWriteError, match="rank 3"):
        _reports.take("never-posted", rank=3, what="w", timeout=60, ended=ended.is_set)
    with pytest.raises(CheckpointTimeoutError, match="rank 5: w did not report within"):
        _reports.take("never-posted", rank=5, what="w", timeout=0.1)


def test_a_report_is_taken_once_and_untaken_ones_stay_bounded() -> None:
    """Reports of saves whose finalize never ran (they failed elsewhere) must not pile up."""
    keys = [uuid.uuid4().hex for _ in range(_reports.KEEP + 5)]
    for key in keys:
        _reports.post(key, key)  # in the trainer: straight into the inbox
    assert _reports.take(keys[-1], rank=0, what="w") == keys[-1]
    with pytest.raises(CheckpointWriteError):
        _reports.take(keys[-1], rank=0, what="w")
    with pytest.raises(CheckpointWriteError):
        _reports.take(keys[0], rank=0, what="w")  # the oldest went first
    assert _reports.take(keys[5], rank=0, what="w") == keys[5]
    assert len(_reports._inbox) <= _reports.KEEP
