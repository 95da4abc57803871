"""Retrying object-store operations: which errors are transient, and the backoff loop.

Decisions:

* **Retry whole operations, at one layer.** Each backend call (upload one object, download
  one object, list a prefix, delete) is retried as a unit, because an object store commits
  a whole object or nothing: a retried upload replays the same buffered bytes, so a retry
  can never leave half an object. The client libraries below have retry loops of their own
  (botocore's, multi-storage-client's ``retry:`` profile section); they compose with this
  one, so a profile that wants exactly this policy sets theirs to one attempt.
* **Classify by the cause chain.** Client libraries wrap the network error they saw (MSC
  turns botocore's ``ConnectionClosedError`` into a ``RuntimeError``), so the whole
  ``__cause__``/``__context__`` chain is examined. Transient: dropped or refused
  connections, timeouts, HTTP 5xx and 429, S3's throttling codes, and whatever the client
  itself marks retryable. A missing object is never transient: ``FileNotFoundError`` passes
  through unchanged, because callers use it to mean "absent". Any other error fails at once.
* **Bounded in tries and in time.** :class:`~resilient_ckpt.config.RetryPolicy` caps the
  number of tries and the time since the first one (the library never waits without a
  deadline); the backoff is exponential with jitter, so ranks that failed together spread
  their retries. Giving up raises :class:`~resilient_ckpt.errors.ObjectStoreError` naming the
  operation, the object, the number of tries and the last error.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from .._logging import get_logger
from ..config import RetryPolicy
from ..errors import CheckpointingException, ObjectStoreError

logger = get_logger(__name__)

T = TypeVar("T")

_THROTTLING_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestLimitExceeded",
        "TooManyRequests",
        "TooManyRequestsException",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "BandwidthLimitExceeded",
    }
)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and its causes/contexts, each once (chains can be cyclic)."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo.extend(e for e in (current.__cause__, current.__context__) if e is not None)


def _client_error_is_transient(exc: BaseException) -> bool:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return False
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    code = response.get("Error", {}).get("Code")
    if isinstance(status, int) and (status >= 500 or status == 429):
        return True
    return code in _THROTTLING_CODES


def _botocore_transient_types() -> tuple[type[BaseException], ...]:
    try:
        from botocore import exceptions as bce
    except ImportError:
        return ()
    return (
        bce.ConnectionError,
        bce.HTTPClientError,
        bce.IncompleteReadError,
        getattr(bce, "ResponseStreamingError", bce.HTTPClientError),
    )


def _is_transient_one(exc: BaseException) -> bool:
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    cls = type(exc)
    if cls.__name__ == "RetryableError" and cls.__module__.startswith("multistorageclient"):
        return True
    if isinstance(exc, _botocore_transient_types()):
        return True
    return _client_error_is_transient(exc)


def is_transient(exc: BaseException) -> bool:
    """True when ``exc`` (or an error it wraps) is worth retrying; see the module docstring."""
    if isinstance(exc, (FileNotFoundError, CheckpointingException)):
        return False
    return any(_is_transient_one(e) for e in _chain(exc))


def describe(exc: BaseException) -> str:
    """``Type: message`` of ``exc``, plus its innermost cause when that says more."""
    text = f"{type(exc).__name__}: {exc}"
    root = exc
    for _ in range(16):  # chains are short; a cyclic one must not loop forever
        inner = root.__cause__ or root.__context__
        if inner is None:
            break
        root = inner
    if root is not exc:
        text += f" (caused by {type(root).__name__}: {root})"
    return text


def call_with_retry(
    fn: Callable[[], T],
    *,
    policy: RetryPolicy,
    operation: str,
    key: str,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    rng: Callable[[], float] = random.random,
) -> T:
    """``fn()``, retried under ``policy`` while it fails transiently.

    ``operation`` and ``key`` (e.g. ``"upload"``, ``"msc://profile/ckpt/.metadata"``) name
    the call in log lines and errors. Raises ``FileNotFoundError`` and library errors as
    they are, :class:`ObjectStoreError` for any other failure.
    """
    started = clock()
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except Exception as exc:
            if isinstance(exc, (FileNotFoundError, CheckpointingException)):
                raise
            if not is_transient(exc):
                raise ObjectStoreError(
                    f"{operation} {key} failed: {describe(exc)} (not a transient error, "
                    "not retried)",
                    operation=operation,
                    key=key,
                    attempts=attempt,
                    last_error=exc,
                ) from exc
            elapsed = clock() - started
            cap = policy.backoff_cap(attempt)
            delay = cap * (1.0 - policy.jitter * rng())
            if attempt >= policy.attempts or elapsed + delay > policy.deadline:
                reason = (
                    f"{attempt} attempt(s), the retry policy allows {policy.attempts}"
                    if attempt >= policy.attempts
                    else f"the retry deadline of {policy.deadline:g}s would pass"
                )
                raise ObjectStoreError(
                    f"{operation} {key} failed after {attempt} attempt(s) in {elapsed:.1f}s "
                    f"({reason}); last error: {describe(exc)}. Transient errors persisted: "
                    "check the endpoint, or allow more with RESILIENT_CKPT_RETRY_ATTEMPTS / "
                    "RESILIENT_CKPT_RETRY_DEADLINE",
                    operation=operation,
                    key=key,
                    attempts=attempt,
                    last_error=exc,
                ) from exc
            logger.warning(
                "%s %s: attempt %d failed (%s); retrying in %.2fs",
                operation,
                key,
                attempt,
                describe(exc),
                delay,
            )
            sleep(delay)
