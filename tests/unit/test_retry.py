"""The retry policy and loop: classification, backoff bounds, deadline, named errors."""

from __future__ import annotations

import errno

import pytest

from resilient_ckpt.config import (
    ObjectStoreOptions,
    RetryPolicy,
    default_object_store_options,
    default_retry_policy,
)
from resilient_ckpt.errors import ConfigurationError, ObjectStoreError
from resilient_ckpt.storage.retry import call_with_retry, describe, is_transient


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def __call__(self) -> float:
        return self.now


def _failing(errors: list[BaseException], result: str = "ok"):
    calls = []

    def fn() -> str:
        calls.append(1)
        if errors:
            raise errors.pop(0)
        return result

    return fn, calls


class _ClientError(Exception):
    """Shaped like botocore's ClientError (a ``response`` dict)."""

    def __init__(self, status: int, code: str) -> None:
        super().__init__(f"{code} ({status})")
        self.response = {"ResponseMetadata": {"HTTPStatusCode": status}, "Error": {"Code": code}}


def _wrapped(inner: BaseException) -> RuntimeError:
    """What multi-storage-client does: a RuntimeError raised from the client's error."""
    try:
        raise inner
    except BaseException as exc:
        try:
            raise RuntimeError("Failed to PUT object(s)") from exc
        except RuntimeError as outer:
            return outer


@pytest.mark.parametrize(
    "exc",
    [
        ConnectionResetError(errno.ECONNRESET, "reset"),
        TimeoutError("read timed out"),
        _ClientError(503, "ServiceUnavailable"),
        _ClientError(500, "InternalError"),
        _ClientError(429, "TooManyRequests"),
        _ClientError(400, "SlowDown"),
        _wrapped(ConnectionResetError("reset by peer")),
        _wrapped(_ClientError(503, "SlowDown")),
    ],
)
def test_transient_errors(exc: BaseException) -> None:
    assert is_transient(exc)


@pytest.mark.parametrize(
    "exc",
    [
        FileNotFoundError("no such key"),
        PermissionError("denied"),
        _ClientError(403, "AccessDenied"),
        _ClientError(404, "NoSuchBucket"),
        ValueError("bad argument"),
        _wrapped(_ClientError(400, "InvalidArgument")),
        ConfigurationError("bad profile"),
    ],
)
def test_permanent_errors(exc: BaseException) -> None:
    assert not is_transient(exc)


def test_botocore_connection_errors_are_transient() -> None:
    bce = pytest.importorskip("botocore.exceptions")
    assert is_transient(_wrapped(bce.ConnectionClosedError(endpoint_url="http://x")))
    assert is_transient(bce.EndpointConnectionError(endpoint_url="http://x"))
    assert is_transient(bce.ReadTimeoutError(endpoint_url="http://x"))


def test_retries_with_jittered_exponential_backoff_then_succeeds() -> None:
    clock = _Clock()
    policy = RetryPolicy(attempts=5, base_delay=1.0, multiplier=2.0, max_delay=3.0, jitter=0.5)
    fn, calls = _failing([ConnectionResetError()] * 4)
    draws = iter([0.0, 1.0, 0.5, 0.0])
    result = call_with_retry(
        fn, policy=policy, operation="upload", key="k", sleep=clock.sleep, clock=clock,
        rng=lambda: next(draws),
    )  # fmt: skip
    assert result == "ok" and len(calls) == 5
    # caps 1, 2, 3 (max_delay), 3; each reduced by jitter * draw
    assert clock.sleeps == [1.0, 1.0, 2.25, 3.0]


def test_gives_up_after_the_attempts_naming_key_and_last_error() -> None:
    clock = _Clock()
    policy = RetryPolicy(attempts=3, base_delay=0.1)
    errors: list[BaseException] = [ConnectionResetError("first"), TimeoutError("second")]
    errors.append(_wrapped(_ClientError(503, "SlowDown")))
    fn, calls = _failing(errors)
    with pytest.raises(ObjectStoreError) as info:
        call_with_retry(
            fn, policy=policy, operation="upload", key="msc://p/ckpt/.metadata",
            sleep=clock.sleep, clock=clock,
        )  # fmt: skip
    assert len(calls) == 3 and len(clock.sleeps) == 2
    err = info.value
    assert err.key == "msc://p/ckpt/.metadata" and err.attempts == 3 and err.operation == "upload"
    assert "msc://p/ckpt/.metadata" in str(err) and "after 3 attempt(s)" in str(err)
    assert "SlowDown" in str(err) and "RESILIENT_CKPT_RETRY_ATTEMPTS" in str(err)
    assert isinstance(err.__cause__, RuntimeError)


def test_deadline_stops_retrying_before_the_attempts_run_out() -> None:
    clock = _Clock()
    policy = RetryPolicy(attempts=100, base_delay=4.0, multiplier=1.0, jitter=0.0, deadline=10)
    fn, calls = _failing([TimeoutError()] * 100)
    with pytest.raises(ObjectStoreError, match="deadline of 10s"):
        call_with_retry(fn, policy=policy, operation="list", key="k", sleep=clock.sleep,
                        clock=clock)  # fmt: skip
    assert len(calls) == 3 and sum(clock.sleeps) == 8.0


def test_permanent_error_is_not_retried_and_missing_passes_through() -> None:
    clock = _Clock()
    fn, calls = _failing([PermissionError("denied")])
    with pytest.raises(ObjectStoreError, match="not a transient error") as info:
        call_with_retry(fn, policy=RetryPolicy(), operation="download", key="k",
                        sleep=clock.sleep, clock=clock)  # fmt: skip
    assert len(calls) == 1 and clock.sleeps == [] and info.value.attempts == 1
    fn, calls = _failing([FileNotFoundError("gone")])
    with pytest.raises(FileNotFoundError):
        call_with_retry(fn, policy=RetryPolicy(), operation="download", key="k",
                        sleep=clock.sleep, clock=clock)  # fmt: skip
    assert len(calls) == 1


def test_object_store_error_pickles_with_its_fields() -> None:
    import pickle

    err = ObjectStoreError("upload k failed", operation="upload", key="k", attempts=4)
    back = pickle.loads(pickle.dumps(err))
    assert (back.key, back.attempts, back.operation, str(back)) == ("k", 4, "upload", str(err))


def test_describe_names_the_innermost_cause() -> None:
    text = describe(_wrapped(ConnectionResetError("reset by peer")))
    assert text.startswith("RuntimeError: Failed to PUT") and "ConnectionResetError" in text


@pytest.mark.parametrize(
    "kwargs",
    [
        {"attempts": 0},
        {"attempts": 2.5},
        {"base_delay": -1},
        {"multiplier": 0.5},
        {"jitter": 1.5},
        {"deadline": "x"},
    ],
)
def test_policy_validation(kwargs) -> None:
    with pytest.raises(ConfigurationError, match="RetryPolicy"):
        RetryPolicy(**kwargs)


def test_policy_and_spool_from_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("RESILIENT_CKPT_RETRY_ATTEMPTS", "9")
    monkeypatch.setenv("RESILIENT_CKPT_RETRY_BASE_DELAY", "0.25")
    monkeypatch.setenv("RESILIENT_CKPT_RETRY_JITTER", "0")
    monkeypatch.setenv("RESILIENT_CKPT_MSC_SPOOL_BYTES", "1024")
    monkeypatch.setenv("RESILIENT_CKPT_MSC_SPOOL_DIR", str(tmp_path))
    policy = default_retry_policy()
    assert (policy.attempts, policy.base_delay, policy.jitter) == (9, 0.25, 0.0)
    assert default_object_store_options() == ObjectStoreOptions(1024, str(tmp_path))
    monkeypatch.setenv("RESILIENT_CKPT_RETRY_ATTEMPTS", "many")
    with pytest.raises(ConfigurationError, match="RESILIENT_CKPT_RETRY_ATTEMPTS"):
        default_retry_policy()
    monkeypatch.setenv("RESILIENT_CKPT_MSC_SPOOL_DIR", str(tmp_path / "missing"))
    with pytest.raises(ConfigurationError, match="RESILIENT_CKPT_MSC_SPOOL_DIR"):
        default_object_store_options()
