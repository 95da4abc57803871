"""The async DCP writer's buckets resolve their tensors when the request is staged (issue 13's
overlapped staging): to readers they are plain lists of pairs, in overlapped staging the
lookups run on the staging thread, and a late failure keeps its own error."""

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


def _planned(path, state: dict, planner=None, **kwargs) -> tuple[FileSystemWriterAsync, tuple]:
    writer = FileSystemWriterAsync(str(path), **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ret = save_state_dict_async_plan(state, writer, planner=planner)
    return writer, ret


def test_the_buckets_read_as_plain_pairs_of_new_tensors_over_the_callers_memory(tmp_path) -> None:
    state = _state()
    writer, _ = _planned(tmp_path / "a", state, thread_count=2)
    buckets = writer.write_buckets
    assert type(buckets) is list and len(buckets) == 2
    pairs = [pair for _, _, (_, tensor_data) in buckets for pair in tensor_data]
    assert all(type(tensor_data) is list for _, _, (_, tensor_data) in buckets)
    assert sorted(item.index.fqn for item, _ in pairs) == [f"w{i}" for i in range(6)]
    for item, tensor in pairs:
        source = state[item.index.fqn]
        # A new object over the caller's memory.
        assert tensor is not source and tensor.data_ptr() == source.data_ptr()
    assert writer.write_buckets is buckets  # built once
    # Handed out and pickled by anything but staging, the payload is the same plain list.
    _, _, args = writer.get_save_function_and_args()
    copied = pickle.loads(pickle.dumps(args[1]))
    assert type(copied) is list and [b[1] for b in copied] == [b[1] for b in buckets]
    for (_, _, (_, ours)), (_, _, (_, theirs)) in zip(buckets, copied, strict=True):
        assert [i.index.fqn for i, _ in ours] == [i.index.fqn for i, _ in theirs]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(ours, theirs, strict=True))


def test_a_custom_planner_resolves_in_the_save_call(tmp_path) -> None:
    calls: list[str] = []

    class Planner(dcp.DefaultSavePlanner):
        def resolve_data(self, write_item):
            calls.append(write_item.index.fqn)
            return super().resolve_data(write_item)

    writer = FileSystemWriterAsync(str(tmp_path / "c"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_state_dict_async_plan(_state(), writer, planner=Planner())
    assert {f"w{i}" for i in range(6)} <= set(calls)


def test_overlapped_staging_resolves_on_the_staging_thread(tmp_path, monkeypatch) -> None:
    threads: list[str] = []

    def recording(resolve):
        def resolving(*args, **kwargs):
            threads.append(threading.current_thread().name)
            return resolve(*args, **kwargs)

        return resolving

    monkeypatch.setattr(_dcp_buckets, "resolve_sources", recording(_dcp_buckets.resolve_sources))
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
    planner = dcp.DefaultSavePlanner()
    writer, _ = _planned(tmp_path / "f", _state(), planner=planner)
    planner.state_dict["w0"] = "not a tensor"  # the plan's flat state, resolved late
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
