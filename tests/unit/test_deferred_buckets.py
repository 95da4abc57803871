"""The async DCP writer's buckets resolve their tensors when the request is staged (issue 13's
overlapped staging): to readers they are the same list of pairs as before, in overlapped
staging the lookups run on the staging thread, and a late failure keeps its own error."""

from __future__ import annotations

import pickle
import threading
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from resilient_ckpt.async_ckpt import _dcp_buckets
from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from resilient_ckpt.async_ckpt.state_dict_saver import (
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from resilient_ckpt.errors import (
    AsyncCallFailedError,
    CheckpointingException,
    ConfigurationError,
)

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::UserWarning")]


def _state() -> dict:
    return {f"w{i}": torch.full((256,), float(i)) for i in range(6)} | {"step": 3}


def _planned(path, state: dict, **kwargs) -> tuple[FileSystemWriterAsync, tuple]:
    writer = FileSystemWriterAsync(str(path), **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ret = save_state_dict_async_plan(state, writer)
    return writer, ret


def _tensor_data(writer: FileSystemWriterAsync) -> list:
    return [bucket[2][1] for bucket in writer.write_buckets or []]


def test_pairs_are_resolved_once_on_first_use_and_read_like_a_list(tmp_path) -> None:
    state = _state()
    writer, _ = _planned(tmp_path / "a", state, thread_count=2)
    buckets = _tensor_data(writer)
    assert buckets and all(b._resolver is not None for b in buckets), "resolved at planning"
    first = buckets[0]
    pairs = list(first)
    assert first._resolver is None and len(first) == len(pairs) > 0
    for item, tensor in pairs:
        source = state[item.index.fqn]
        # A new object over the caller's memory, as the eager path gave.
        assert tensor is not source and tensor.data_ptr() == source.data_ptr()
    assert first[0] is pairs[0] and first == pairs and pairs[0] in first
    # Pickled before any use (what staging does), it travels as a plain list of pairs
    # without resolving the bucket itself: the pickler finds the tensors.
    second = buckets[1]
    copied = pickle.loads(pickle.dumps(second))
    assert type(copied) is list and second._resolver is not None
    assert [i.index.fqn for i, _ in copied] == [i.index.fqn for i, _ in second]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(copied, second, strict=True))


def test_a_custom_planner_resolves_at_once(tmp_path) -> None:
    class Planner(dcp.DefaultSavePlanner):
        def resolve_data(self, write_item):
            return super().resolve_data(write_item)

    writer = FileSystemWriterAsync(str(tmp_path / "c"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_state_dict_async_plan(_state(), writer, planner=Planner())
    assert all(b._resolver is None and len(b) for b in _tensor_data(writer))


def test_overlapped_staging_resolves_on_the_staging_thread(tmp_path, monkeypatch) -> None:
    threads: list[str] = []

    def recording(resolve):
        def resolving(*args, **kwargs):
            threads.append(threading.current_thread().name)
            return resolve(*args, **kwargs)

        return resolving

    for name in ("resolve_sources", "quick_sources"):
        monkeypatch.setattr(_dcp_buckets, name, recording(getattr(_dcp_buckets, name)))
    state = _state()
    queue = AsyncCallsQueue()
    try:
        writer, ret = _planned(tmp_path / "o", state)
        save_fn, preload_fn, args = writer.get_save_function_and_args()
        assert threads == [], "resolved before the save call returned"
        finalize = [lambda: save_state_dict_async_finalize(*ret)]
        request = AsyncRequest(save_fn, args, finalize, preload_fn=preload_fn)
        queue.schedule_async_request(request, overlap_staging=True)
        queue.wait_for_snapshot()
        for value in state.values():
            if torch.is_tensor(value):
                value.fill_(-1.0)  # after the wait: not in the checkpoint
        queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    finally:
        queue.close()
    assert threads and all(name.startswith("resilient_ckpt-stage") for name in threads)
    loaded = {k: torch.zeros(256) for k in state if k != "step"} | {"step": 0}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "o"))
    assert all(torch.equal(loaded[f"w{i}"], torch.full((256,), float(i))) for i in range(6))
    assert loaded["step"] == 3


def test_a_late_resolution_failure_keeps_its_own_error(tmp_path) -> None:
    writer, _ = _planned(tmp_path / "f", _state())
    bucket = _tensor_data(writer)[0]
    flat = bucket._resolver.flat  # the plan's flat state
    flat[bucket.blob.fqns[0]] = "not a tensor"  # e.g. a planner that resolves badly
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    queue = AsyncCallsQueue()
    try:
        with pytest.raises(ConfigurationError, match="tensor item") as info:
            queue.schedule_async_request(AsyncRequest(save_fn, args, [], preload_fn=preload_fn))
        assert isinstance(info.value, CheckpointingException)
        assert "cannot be sent" not in str(info.value)
        # Kept as a failed call: the finalize (every rank's, in a job) reports it once.
        with pytest.raises(AsyncCallFailedError, match="tensor item"):
            queue.maybe_finalize_async_calls(blocking=True)
        assert queue.get_num_unfinalized_calls() == 0
    finally:
        queue.close()
