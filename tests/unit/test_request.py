from __future__ import annotations

import functools
import logging

import pytest
import torch

from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from resilient_ckpt.errors import (
    CheckpointingException,
    FrozenRequestError,
    InvalidRequestError,
)
from resilient_ckpt.utils import debug_time, diff, preload_tensors
from tests import _helpers


def test_async_request_field_order_and_defaults() -> None:
    assert AsyncRequest._fields == (
        "async_fn",
        "async_fn_args",
        "finalize_fns",
        "async_fn_kwargs",
        "preload_fn",
        "is_frozen",
        "call_idx",
    )
    req = AsyncRequest(print, (), [])
    assert req.async_fn_kwargs is None and req.preload_fn is None
    assert req.is_frozen is False and req.call_idx == 0


def test_add_finalize_fn_and_freeze() -> None:
    calls: list[int] = []
    req = AsyncRequest(None, (), [])
    req.add_finalize_fn(lambda: calls.append(1))
    frozen = req.freeze()
    assert frozen.is_frozen and not req.is_frozen
    with pytest.raises(FrozenRequestError) as info:
        frozen.add_finalize_fn(lambda: None)
    assert isinstance(info.value, RuntimeError)  # NVRx raised RuntimeError
    assert isinstance(info.value, CheckpointingException)
    frozen.execute_finalize_fns(validate_matching_call_idx=False)
    assert calls == [1]


def test_execute_sync_runs_preload_then_async_then_finalize(tmp_path) -> None:
    order: list[str] = []
    out = tmp_path / "x.pt"
    state = {"a": torch.arange(4)}

    def preload() -> dict:
        order.append("preload")
        return {"a": state["a"] * 2}

    req = AsyncRequest(
        _helpers.write_tensors, (str(out), None), [lambda: order.append("fin")], preload_fn=preload
    )
    req.execute_sync()
    assert order == ["preload", "fin"]
    assert torch.equal(torch.load(out)["a"], torch.arange(4) * 2)


@pytest.mark.parametrize(
    "request_factory, fragment",
    [
        (lambda: AsyncRequest(42, (), []), "async_fn must be callable"),
        (lambda: AsyncRequest(print, "nope", []), "async_fn_args must be a tuple"),
        (lambda: AsyncRequest(print, (), [], async_fn_kwargs=[1]), "async_fn_kwargs"),
        (lambda: AsyncRequest(print, (), [3]), "finalize_fns"),
        (lambda: AsyncRequest(print, (1,), [], preload_fn=print), "only 1 element"),
        (lambda: AsyncRequest(print, (1, 2), [], preload_fn=7), "preload_fn must be callable"),
    ],
)
def test_bad_requests_raise_named_errors(request_factory, fragment) -> None:
    queue = AsyncCallsQueue()
    with pytest.raises(InvalidRequestError, match=fragment):
        queue.schedule_async_request(request_factory())
    assert queue.get_num_unfinalized_calls() == 0
    assert queue.persistent_caller is None  # nothing was started for a bad request
    queue.close()


def test_preload_returning_none_is_an_error() -> None:
    req = AsyncRequest(print, (1, 2), [], preload_fn=_helpers.return_none)
    with pytest.raises(InvalidRequestError, match="preload_fn returned None"):
        req.execute_sync()


def test_debug_time_context_and_decorator(caplog) -> None:
    log = logging.getLogger("test.debug_time")
    with caplog.at_level(logging.DEBUG, logger="test.debug_time"):
        with debug_time("block", log) as timer:
            pass

        @debug_time("func", log)
        def work() -> int:
            return 3

        assert work() == 3
    messages = [r.getMessage() for r in caplog.records]
    assert timer.elapsed is not None  # the measurement it logged stays readable
    assert f"block took {timer.elapsed:.6f}s" in messages
    assert any(m.startswith("func took ") and m.endswith("s") for m in messages)


def test_preload_tensors_copies_never_aliases() -> None:
    state = {"a": torch.ones(3), "nested": [torch.zeros(2), 5], "t": (torch.ones(1),)}
    out = preload_tensors(state)
    state["a"].add_(1)
    state["nested"][0].add_(1)
    assert torch.equal(out["a"], torch.ones(3))
    assert torch.equal(out["nested"][0], torch.zeros(2))
    assert out["nested"][1] == 5 and isinstance(out["t"], tuple)


def test_diff_reports_left_right_and_mismatch() -> None:
    left = {"a": torch.ones(2), "b": 1, "c": [1, 2]}
    right = {"a": torch.zeros(2), "d": 2, "c": [1, 2, 3]}
    only_left, only_right, mismatch = diff(left, right)
    assert only_left == [("b",)]
    assert sorted(only_right) == [("c", 2), ("d",)]
    assert [m[0] for m in mismatch] == [("a",)]
    assert diff(left, left) == ([], [], [])


def test_partial_requests_pickle() -> None:
    fn = functools.partial(_helpers.write_tensors)
    assert callable(fn)
