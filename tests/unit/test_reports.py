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
from resilient_ckpt.errors import CheckpointTimeoutError, CheckpointWriteError, WorkerDiedError

FAST = Timeouts(worker_start=90, finalize=30, collective=60, shutdown=10, poll_interval=0.02)

pytestmark = pytest.mark.timeout(120)


def _post_then_wait(reports: _reports.Reports, key: str, value: object, release: str) -> None:
    """Background function: post a report, then go on working until ``release`` exists."""
    _reports.post(reports, key, value)
    deadline = time.monotonic() + 30
    while not os.path.exists(release):
        if time.monotonic() > deadline:
            raise TimeoutError("the trainer never took the report")
        time.sleep(0.01)


def test_a_worker_report_is_taken_while_its_call_runs_without_polling_the_queue(
    tmp_path,
) -> None:
    """As the tiered manager's replicator thread does: the call is still running and
    nobody polls the queue; the caller's receiver thread files the report."""
    key = uuid.uuid4().hex
    release = str(tmp_path / "release")
    queue = AsyncCallsQueue(timeouts=FAST)
    try:
        idx = queue.schedule_async_request(
            AsyncRequest(_post_then_wait, (_reports.Reports(), key, {"files": 3}, release), [])
        )
        box = queue.reports_of(idx)
        assert box is not None
        taken: list[object] = []
        thread = threading.Thread(
            target=lambda: taken.append(_reports.take(key, rank=0, what="w", call=box, timeout=60))
        )
        thread.start()
        thread.join(60)
        assert taken == [{"files": 3}]
        assert queue.get_num_unfinalized_calls() == 1  # the call was still running
        open(release, "w").close()
        assert queue.maybe_finalize_async_calls(blocking=True) == [idx]
    finally:
        queue.close()


@pytest.mark.parametrize("persistent", [True, False])
def test_the_finalize_takes_its_calls_report(tmp_path, persistent) -> None:
    """A forked child's report larger than its pipe (the trainer reads it meanwhile), or the
    worker's: a finalize function finds it as the call's, with no box passed in."""
    key = uuid.uuid4().hex
    release = str(tmp_path / "release")
    open(release, "w").close()
    big = os.urandom(4 << 20)
    taken: list[object] = []
    queue = AsyncCallsQueue(persistent=persistent, timeouts=FAST)
    try:
        finalize = [lambda: taken.append(_reports.take(key, rank=0, what="w"))]
        queue.schedule_async_request(
            AsyncRequest(_post_then_wait, (_reports.Reports(), key, big, release), finalize)
        )
        assert queue.maybe_finalize_async_calls(blocking=True) == [0]
        assert taken == [big]
    finally:
        queue.close()


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def test_a_dead_worker_ends_the_wait_for_its_report() -> None:
    queue = AsyncCallsQueue(timeouts=FAST)
    try:
        idx = queue.schedule_async_request(AsyncRequest(_sleep, (60,), []))
        box = queue.reports_of(idx)
        assert box is not None
        caller = queue.persistent_caller
        assert caller is not None
        caller.process.kill()
        started = time.monotonic()
        with pytest.raises(CheckpointWriteError, match="rank 2: w ended without"):
            _reports.take("never-posted", rank=2, what="w", call=box, timeout=60)
        assert time.monotonic() - started < 30
        with pytest.raises(WorkerDiedError):
            queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    finally:
        queue.close(abort=True)


def test_a_missing_report_is_a_named_error() -> None:
    with pytest.raises(CheckpointWriteError, match="rank 3: the write to x ended without"):
        _reports.take("never-posted", rank=3, what="the write to x")
    box = _reports.Reports()
    threading.Timer(0.2, box.end).start()
    with pytest.raises(CheckpointWriteError, match="rank 3"):
        _reports.take("never-posted", rank=3, what="w", call=box, timeout=60)
    with pytest.raises(CheckpointTimeoutError, match="rank 5: w did not report within"):
        _reports.take("never-posted", rank=5, what="w", call=_reports.Reports(), timeout=0.1)


def test_a_report_is_taken_once_and_a_forgotten_calls_reports_go() -> None:
    """In the trainer a report lands in the box it is posted with; a caller drops the reports
    of the calls it forgot (failed saves whose finalize never ran), late ones included."""
    local = _reports.Reports()
    _reports.post(local, "k", 1)
    assert _reports.take("k", rank=0, what="w", local=local) == 1
    with pytest.raises(CheckpointWriteError):
        _reports.take("k", rank=0, what="w", local=local)
    mailbox = _reports.Mailbox()
    mailbox.report(1, "a", "first")
    mailbox.report(2, "b", "second")
    mailbox.forget(1)
    mailbox.report(1, "late", "dropped")
    assert mailbox.reports_of(1).ended
    with pytest.raises(CheckpointWriteError):
        _reports.take("a", rank=0, what="w", call=mailbox.reports_of(1))
    assert _reports.take("b", rank=0, what="w", call=mailbox.reports_of(2)) == "second"
