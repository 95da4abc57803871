"""Deferred DCP planning in one process (``defer_planning=True``): what the call hands out
before the planning ran (the planning as the ``preload_fn``, the metadata as a future), and
every way the planning runs or refuses to be used unplanned. The multi-rank behaviour is in
``tests/dist/test_deferred_plan_dist.py``."""

from __future__ import annotations

import pickle
from concurrent.futures import Future

import pytest
import torch
import torch.distributed.checkpoint as dcp

from resilient_ckpt.async_ckpt._staging import PlanStep
from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from resilient_ckpt.async_ckpt.state_dict_saver import (
    CheckpointMetadataCache,
    planned_metadata,
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
            save_fn, preload_fn, args = writer.get_save_function_and_args()
            assert isinstance(preload_fn, PlanStep) == (k > 0), k
            assert isinstance(ret[1], Future) == (k > 0), k
            if k > 0:
                # Nothing planned yet: no items, the metadata a future not yet set.
                assert args[1] is None and preload_fn.items is None and not ret[1].done()
            finalize = [lambda ret=ret: save_state_dict_async_finalize(*ret)]
            queue.schedule_async_request(
                AsyncRequest(save_fn, args, finalize, preload_fn=preload_fn)
            )
            if k > 0:
                assert preload_fn.items and "w.p0" in ret[1].result().state_dict_metadata
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

    writer, ret = _plan(_state(), tmp_path / "c1", cache)
    with pytest.raises(CheckpointWriteError, match="deferred planning of this save did not run"):
        writer.retrieve_write_results()
    with pytest.raises(InvalidRequestError, match="deferred planning of this save did not run"):
        planned_metadata(ret[1])
    _, preload_fn, _ = writer.get_save_function_and_args()
    with pytest.raises(InvalidRequestError, match="defer_planning=True"):
        pickle.dumps(preload_fn)


def test_a_failed_deferred_planning_fails_its_metadata_and_is_not_run_again(tmp_path) -> None:
    cache = CheckpointMetadataCache()
    queue = AsyncCallsQueue()
    try:
        for k, bad in enumerate((False, True)):
            state = _state()
            if bad:
                state[7] = torch.ones(2)  # a key DCP cannot load back: the planning refuses
            writer, ret = _plan(state, tmp_path / f"c{k}", cache)
            save_fn, preload_fn, args = writer.get_save_function_and_args()
            request = AsyncRequest(
                save_fn, args, [lambda ret=ret: save_state_dict_async_finalize(*ret)]
            )
            if not bad:
                queue.schedule_async_request(request._replace(preload_fn=preload_fn))
                queue.maybe_finalize_async_calls(blocking=True)
                continue
            with pytest.raises(ConfigurationError, match="string keys"):
                queue.schedule_async_request(request._replace(preload_fn=preload_fn))
            assert isinstance(ret[1].exception(), ConfigurationError)
            with pytest.raises(InvalidRequestError, match="failed before: .*string keys"):
                preload_fn()
    finally:
        queue.close(abort=True)  # the failed call, reported by a finalize, is dropped


def test_a_planning_run_once_is_staged_as_plain_data() -> None:
    calls = []

    def plan() -> list:
        calls.append(1)
        return [("a", "b", ([], []))]

    step = PlanStep(plan, list, "the test save")
    args, preload_fn = step.planned((0, None))
    assert step.planned((0, None))[0] == args and step() == [("a", "b", ([], []))]
    assert calls == [1]
    loaded_args, loaded_preload = pickle.loads(pickle.dumps((args, preload_fn)))
    assert loaded_args == (0, [("a", "b", ([], []))]) and loaded_preload() == loaded_args[1]


def test_a_planning_that_prepares_no_write_is_an_error(tmp_path) -> None:
    writer = FileSystemWriterAsync(str(tmp_path / "c"))
    writer.defer_write_data(lambda: None)
    _, preload_fn, _ = writer.get_save_function_and_args()
    with pytest.raises(InvalidRequestError, match="prepared no write"):
        preload_fn()


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
    step = PlanStep(lambda: [order.append(("planned", nested()))], list, "the test save")
    assert step.run() == [None]
    running.result()
    assert [what for what, _ in order] == ["earlier", "planned"]
    assert all(name.startswith("resilient_ckpt-stage") for _, name in order), order
