"""Overlapped staging (issue 13): the whole staging runs on a
background thread, so the call returns at once; a staging that fails is reported by the
explicit wait and, like a worker's failure, by finalizing the call, never lost or hung."""

from __future__ import annotations

import threading

import pytest
import torch

from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from resilient_ckpt.errors import CheckpointingException, InvalidRequestError

pytestmark = pytest.mark.timeout(120)


def _save(path: str, state: dict) -> None:
    torch.save(state, path)


class _RecordsPicklingThread:
    """Pickles as a plain marker; remembers on which thread it was pickled."""

    threads: list[str] = []

    def __reduce__(self):
        type(self).threads.append(threading.current_thread().name)
        return (str, ("marker",))


def test_the_request_is_pickled_on_the_staging_thread_and_saved_as_called(tmp_path) -> None:
    queue = AsyncCallsQueue()
    try:
        state = {"w": torch.arange(1000.0), "marker": _RecordsPicklingThread(), "step": 1}
        path = str(tmp_path / "a.pt")
        queue.schedule_async_request(AsyncRequest(_save, (path, state), []), overlap_staging=True)
        queue.wait_for_snapshot()
        state["w"].fill_(-1)  # after the wait: not in the checkpoint
        queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
        saved = torch.load(path, weights_only=False)
        assert torch.equal(saved["w"], torch.arange(1000.0)) and saved["marker"] == "marker"
        assert _RecordsPicklingThread.threads[-1].startswith("resilient_ckpt-stage")
    finally:
        queue.close()


def _unpicklable_request(tmp_path) -> AsyncRequest:
    return AsyncRequest(_save, (str(tmp_path / "bad.pt"), {"lock": threading.Lock()}), [])


def _good_save(queue: AsyncCallsQueue, tmp_path, name: str) -> None:
    path = str(tmp_path / name)
    queue.schedule_async_request(
        AsyncRequest(_save, (path, {"w": torch.ones(8)}), []), overlap_staging=True
    )
    queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    assert torch.equal(torch.load(path)["w"], torch.ones(8))


@pytest.mark.parametrize("explicit_wait", [True, False], ids=["wait", "implicit"])
def test_a_staging_failure_is_reported_and_the_queue_goes_on(tmp_path, explicit_wait) -> None:
    queue = AsyncCallsQueue()
    try:
        queue.schedule_async_request(_unpicklable_request(tmp_path), overlap_staging=True)
        if explicit_wait:
            with pytest.raises(InvalidRequestError, match="cannot be sent to the background"):
                queue.wait_for_snapshot()
        # Finalizing reports the failure (on every rank, in a distributed run).
        with pytest.raises(CheckpointingException, match="cannot be sent to the background"):
            queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
        pool = queue.persistent_caller._pool
        assert not pool.busy  # nothing kept an arena
        _good_save(queue, tmp_path, "after.pt")
    finally:
        queue.close()
