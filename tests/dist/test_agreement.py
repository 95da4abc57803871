"""resilient_ckpt._dist.agree on gloo: one outcome, one error type, on every rank."""

from __future__ import annotations

import pickle

import pytest
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

from resilient_ckpt import _dist
from resilient_ckpt.errors import (
    CheckpointingException,
    ConfigurationError,
    RankConfigurationError,
    RankFailureError,
    RemoteTraceback,
    StorageError,
)
from resilient_ckpt.testing import launch

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


def _failing_step(rank: int) -> None:
    if rank == 1:
        raise ConfigurationError(f"bad setting on rank {rank}")
    if rank == 2:
        raise OSError(28, "No space left on device")


def _agree_cases(rank: int, world: int) -> dict:
    out: dict = {}
    # Success: every rank's integers, then every rank's payload, in rank order.
    out["ints"] = [o.ints for o in _dist.agree("ints", None, ints=(rank, 7))]
    payloads = _dist.agree("payload", None, payload={"r": rank}, with_payload=True)
    out["payloads"] = [o.payload for o in payloads]
    # Failure on ranks 1 and 2: the same class and message on every rank.
    for transport in ("ints", "payload"):
        error = None
        try:
            _failing_step(rank)
        except Exception as exc:
            error = exc
        try:
            _dist.agree("step", error, ints=(1,), with_payload=transport == "payload")
            out[transport + "_raised"] = None
        except CheckpointingException as exc:
            assert isinstance(exc, CheckpointException)  # torch's family catches it too
            cause = exc.__cause__
            out[transport + "_raised"] = {
                "type": type(exc).__name__,
                "message": str(exc),
                "ranks": list(exc.failed_ranks),
                "torch_ranks": sorted(exc.failures),
                "tb1": exc.tracebacks[1],
                "cause": type(cause).__name__,
                "remote_tb": cause.tb if isinstance(cause, RemoteTraceback) else "",
                "value_error": isinstance(exc, ValueError),
                "roundtrip": str(pickle.loads(pickle.dumps(exc))) == str(exc),
            }
    # The collectives stay in step after a failure.
    out["after"] = [o.ints for o in _dist.agree("after", None, ints=(rank,))]
    out["group_backend"] = dist.get_backend(_dist.library_group())
    return out


def test_agree_returns_every_outcome_and_raises_one_error_everywhere() -> None:
    results = launch(_agree_cases, 3, timeout=100)
    for rank, res in enumerate(results):
        assert res["ints"] == [(0, 7), (1, 7), (2, 7)]
        assert res["payloads"] == [{"r": 0}, {"r": 1}, {"r": 2}]
        for transport in ("ints", "payload"):
            raised = res[transport + "_raised"]
            assert raised is not None, (rank, transport)
            # The first failed rank's kind decides: a ConfigurationError stays one.
            assert raised["type"] == "RankConfigurationError" and raised["value_error"]
            assert raised["ranks"] == [1, 2] and raised["torch_ranks"] == [1, 2]
            assert "step failed on rank(s) [1, 2]" in raised["message"]
            assert "bad setting on rank 1" in raised["message"]
            assert "No space left on device" in raised["message"]
            assert "_failing_step" in raised["tb1"]  # the remote traceback travels
            assert raised["roundtrip"]
            if rank in (1, 2):
                assert raised["cause"] in ("ConfigurationError", "OSError")
            else:
                assert raised["cause"] == "RemoteTraceback"
                assert "bad setting on rank 1" in raised["remote_tb"]
        assert res["after"] == [(0,), (1,), (2,)]
        assert res["group_backend"] == "gloo"


def _decide_cases(rank: int, world: int) -> dict:
    out: dict = {}
    seen: list[list] = []

    def act(payloads: list) -> list:
        seen.append(payloads)
        return [f"part {r} of {sum(payloads)}" for r in range(len(payloads))]

    # Success: the coordinator (rank 1) alone acts on every payload; each rank its part.
    out["scattered"] = _dist.decide("plan", None, rank + 1, act, coordinator=1, scatter=True)
    out["broadcast"] = _dist.decide("sum", None, rank, sum, coordinator=2)
    # A rank's error: nobody acts, every rank raises the same error naming it.
    error = ConfigurationError("bad input on rank 0") if rank == 0 else None
    try:
        _dist.decide("commit", error, rank, act, coordinator=1)
    except CheckpointingException as exc:
        out["rank_failed"] = (type(exc).__name__, list(exc.failed_ranks), str(exc))

    # The act's error is the coordinator's failure, on every rank.
    def failing(payloads: list) -> None:
        raise OSError(28, "No space left on device")

    try:
        _dist.decide("commit", None, rank, failing, coordinator=2)
    except CheckpointingException as exc:
        out["act_failed"] = (type(exc).__name__, list(exc.failed_ranks), str(exc))
    # On a caller's group (ranks 1 and 2; its rank 1 is global rank 2) only its ranks take part.
    sub = dist.new_group([1, 2], backend="gloo")
    if rank in (1, 2):
        out["sub"] = _dist.decide("sub", None, rank, act, coordinator=1, scatter=True, group=sub)
    out["acts"] = len(seen)
    out["after"] = [o.ints for o in _dist.agree("after", None, ints=(rank,))]
    return out


def test_decide_gathers_on_the_coordinator_and_raises_one_error_everywhere() -> None:
    results = launch(_decide_cases, 3, timeout=100)
    for rank, res in enumerate(results):
        assert res["scattered"] == f"part {rank} of 6"
        assert res["broadcast"] == 3
        kind, ranks, message = res["rank_failed"]
        assert kind == "RankConfigurationError" and ranks == [0]
        assert "commit failed on rank(s) [0]: ConfigurationError: bad input on rank 0" in message
        kind, ranks, message = res["act_failed"]
        assert kind == "RankStorageError" and ranks == [2]
        assert "No space left on device" in message
        assert res["after"] == [(0,), (1,), (2,)]
    assert results[0]["acts"] == 0 and results[1]["acts"] == 1 and results[2]["acts"] == 1
    assert results[1]["sub"] == "part 0 of 3" and results[2]["sub"] == "part 1 of 3"
    assert "sub" not in results[0]


def test_decide_alone_acts_here() -> None:
    assert _dist.decide("one", None, 5, lambda ps: ps[0] * 2, local_only=True) == 10
    assert _dist.decide("one", None, 5, lambda ps: [ps[0]], scatter=True, local_only=True) == 5
    with pytest.raises(RankConfigurationError, match=r"one failed on rank\(s\) \[0\]"):
        _dist.decide("one", ConfigurationError("bad"), None, lambda ps: None, local_only=True)
    with pytest.raises(StorageError) as info:
        _dist.decide("one", None, 5, lambda ps: open("/nonexistent/x"), local_only=True)
    assert isinstance(info.value.failures[0][0], FileNotFoundError)  # the act's own error


def test_error_family_single_process() -> None:
    assert issubclass(RankFailureError, CheckpointingException)
    assert issubclass(RankFailureError, CheckpointException)
    assert issubclass(RankFailureError, Exception)  # unlike torch's own class
    assert issubclass(RankConfigurationError, ConfigurationError)
    with pytest.raises(StorageError, match=r"write failed on rank\(s\) \[0\]") as info:
        _dist.agree("write", OSError(5, "I/O error"), local_only=True)
    assert isinstance(info.value, CheckpointException)
    assert list(info.value.failures) == [0]
    assert info.value.failures[0][0].errno == 5  # this rank's own exception, for torch
    assert _dist.agree("fine", None, ints=(3,), local_only=True)[0].ints == (3,)


def test_failed_dcp_save_is_caught_by_both_families(tmp_path) -> None:
    import torch

    from resilient_ckpt.async_ckpt.core import AsyncRequest
    from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
    from resilient_ckpt.async_ckpt.state_dict_saver import (
        save_state_dict_async_finalize,
        save_state_dict_async_plan,
    )
    from resilient_ckpt.errors import CheckpointExistsError

    def save(overwrite: bool) -> None:
        writer = FileSystemWriterAsync(str(tmp_path / "ck"), overwrite=overwrite)
        plan = save_state_dict_async_plan({"w": torch.ones(4)}, writer)
        save_fn, preload_fn, args = writer.get_save_function_and_args()
        finalize = [lambda: save_state_dict_async_finalize(*plan)]
        AsyncRequest(save_fn, args, finalize, preload_fn=preload_fn).execute_sync()

    save(overwrite=True)
    with pytest.raises(CheckpointingException, match=r"failed on rank\(s\) \[0\]") as info:
        save(overwrite=False)
    assert isinstance(info.value, CheckpointException) and list(info.value.failures) == [0]
    assert isinstance(info.value.failures[0][0], CheckpointExistsError)
