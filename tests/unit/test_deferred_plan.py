"""Deferred DCP planning in one process (``defer_planning=True``): what the call hands out
before the planning ran, and every way the payload gets planned or refuses to be used
unplanned. The multi-rank behaviour is in ``tests/dist/test_deferred_plan_dist.py``."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from resilient_ckpt.async_ckpt._staging import DeferredList
from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from resilient_ckpt.async_ckpt.state_dict_saver import (
    CheckpointMetadataCache,
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from resilient_ckpt.errors import (
    CheckpointWriteError,
    ConfigurationError,
    InvalidRequestError,
)

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::UserWarning")]


def _state(scale: float = 1.0) -> dict:
    return {"w": {f"p{i}": torch.full((32 + i,), scale * i) for i in range(5)}, "step": 4}


def _plan(state: dict, path, cache: CheckpointMetadataCache):
    writer = FileSystemWriterAsync(str(path), thread_count=2)
    ret = save_state_dict_async_plan(
        state, writer, enable_cache=True, metadata_cache=cache, defer_planning=True
    )
    return writer, ret


def _loaded(path, like: dict) -> dict:
    target = {"w": {k: torch.zeros_like(v) for k, v in like["w"].items()}, "step": -1}
    dcp.load(target, checkpoint_id=str(path))
    return target


def _same(a: dict, b: dict) -> bool:
    return a["step"] == b["step"] and all(torch.equal(a["w"][k], v) for k, v in b["w"].items())


def test_defer_planning_needs_the_plan_cache(tmp_path) -> None:
    writer = FileSystemWriterAsync(str(tmp_path / "c"))
    with pytest.raises(ConfigurationError, match="enable_cache=True"):
        save_state_dict_async_plan(_state(), writer, defer_planning=True)


def test_the_first_save_plans_in_the_call_later_ones_at_staging(tmp_path) -> None:
    cache = CheckpointMetadataCache()
    queue = AsyncCallsQueue()
    try:
        for k in range(3):
            state = _state(k + 1.0)
            writer, ret = _plan(state, tmp_path / f"c{k}", cache)
            buckets = writer.write_buckets
            assert isinstance(buckets, DeferredList) == (k > 0), k
            if k > 0:
                # Nothing planned yet: the coordinator's metadata is an empty placeholder.
                assert not buckets.resolved and ret[1] is not None
                assert ret[1].state_dict_metadata == {}
            save_fn, preload_fn, args = writer.get_save_function_and_args()
            finalize = [lambda ret=ret: save_state_dict_async_finalize(*ret)]
            queue.schedule_async_request(
                AsyncRequest(save_fn, args, finalize, preload_fn=preload_fn)
            )
            if k > 0:
                assert buckets.resolved and "w.p0" in ret[1].state_dict_metadata
            queue.maybe_finalize_async_calls(blocking=True)
            assert _same(_loaded(tmp_path / f"c{k}", state), state), k
    finally:
        queue.close()


def test_preload_fn_plans_a_deferred_save_run_without_a_queue(tmp_path) -> None:
    cache = CheckpointMetadataCache()
    for k in range(2):
        state = _state(k + 2.0)
        if k == 1:
            state["w"]["p9"] = torch.ones(3)  # a changed structure: planned in full
        writer, ret = _plan(state, tmp_path / f"c{k}", cache)
        save_fn, preload_fn, args = writer.get_save_function_and_args()
        request = AsyncRequest(
            save_fn, args, [lambda ret=ret: save_state_dict_async_finalize(*ret)]
        )
        request._replace(preload_fn=preload_fn).execute_sync()
        assert _same(_loaded(tmp_path / f"c{k}", state), state), k


def test_an_unplanned_payload_refuses_to_be_written(tmp_path) -> None:
    cache = CheckpointMetadataCache()
    writer, ret = _plan(_state(), tmp_path / "c0", cache)  # the first save plans here
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    save_fn(args[0], preload_fn())
    save_state_dict_async_finalize(*ret)

    writer, _ = _plan(_state(), tmp_path / "c1", cache)
    with pytest.raises(CheckpointWriteError, match="deferred planning of this save did not run"):
        writer.retrieve_write_results()
    _, _, args = writer.get_save_function_and_args()
    with pytest.raises(InvalidRequestError, match="defer_planning=True"):
        pickle.dumps(args)


def test_a_failed_deferred_planning_is_not_run_again() -> None:
    calls = []

    def complete() -> None:
        calls.append(1)
        raise ConfigurationError("bad state")

    buckets = DeferredList(complete, "the test save")
    with pytest.raises(ConfigurationError, match="bad state"):
        buckets.resolve()
    with pytest.raises(InvalidRequestError, match="failed before: bad state"):
        buckets.resolve()
    assert calls == [1]


def test_a_resolved_payload_pickles_as_a_plain_list() -> None:
    buckets = DeferredList(lambda: buckets.fill([("a", "b", ([], []))]), "the test save")
    assert buckets.resolve() is buckets and buckets.resolve() is buckets
    loaded = pickle.loads(pickle.dumps(buckets))
    assert type(loaded) is list and loaded == [("a", "b", ([], []))]


def test_a_planning_that_fills_nothing_is_an_error() -> None:
    buckets = DeferredList(lambda: None, "the test save")
    with pytest.raises(InvalidRequestError, match="gave nothing"):
        buckets.resolve()


def test_deferred_planning_runs_on_the_staging_thread_after_earlier_stagings() -> None:
    import threading
    import time

    from resilient_ckpt.async_ckpt import _staging

    order: list[tuple[str, str]] = []

    def earlier() -> None:  # an overlapped staging still running
        time.sleep(0.2)
        order.append(("earlier", threading.current_thread().name))

    def nested() -> str:  # on the staging thread already: runs inline, no deadlock
        return _staging.in_staging_order(lambda: threading.current_thread().name)

    running = _staging._STAGER.get(1).submit(earlier)
    buckets = DeferredList(
        lambda: (order.append(("planned", nested())), buckets.fill([1]))[-1], "the test save"
    )
    assert buckets.resolve() == [1]
    running.result()
    assert [what for what, _ in order] == ["earlier", "planned"]
    assert all(name.startswith("resilient_ckpt-stage") for _, name in order), order
