"""Deadlines and tunables, and the one place where environment variables are read.

Every wait in the library has a deadline taken from a :class:`Timeouts` value. The defaults
suit a real job (a slow parallel file system can take minutes to write a large checkpoint);
tests and impatient users shrink them either per object (the ``timeouts=`` keyword on
queues and callers) or process-wide with the environment variables below, read once per
call of :func:`default_timeouts` so a test can change them with ``monkeypatch``.

=====================================  ==========================================  =======
variable                               meaning                                     default
=====================================  ==========================================  =======
RESILIENT_CKPT_WORKER_START_TIMEOUT    worker start + handshake                    120 s
RESILIENT_CKPT_FINALIZE_TIMEOUT        blocking wait for a request, all ranks      1800 s
RESILIENT_CKPT_COLLECTIVE_TIMEOUT      the library's gloo group collectives        1800 s
RESILIENT_CKPT_SHUTDOWN_TIMEOUT        close(): drain before terminate/kill        30 s
RESILIENT_CKPT_POLL_INTERVAL           sleep between polls of a blocking wait      0.05 s
=====================================  ==========================================  =======

Object stores (``msc://`` paths) retry transient errors under a :class:`RetryPolicy` and
buffer each object before its upload under :class:`ObjectStoreOptions`:

=====================================  ==========================================  =======
variable                               meaning                                     default
=====================================  ==========================================  =======
RESILIENT_CKPT_RETRY_ATTEMPTS          tries per object operation (1 = no retry)   6
RESILIENT_CKPT_RETRY_BASE_DELAY        backoff before the 2nd try                  0.5 s
RESILIENT_CKPT_RETRY_MULTIPLIER        backoff growth per try                      2.0
RESILIENT_CKPT_RETRY_MAX_DELAY         cap of one backoff                          30 s
RESILIENT_CKPT_RETRY_JITTER            random share of each backoff (0..1)         1.0
RESILIENT_CKPT_RETRY_DEADLINE          give up once an operation has taken this    600 s
RESILIENT_CKPT_MSC_SPOOL_BYTES         upload buffer kept in memory, then a file   256 MiB
RESILIENT_CKPT_MSC_SPOOL_DIR           where larger buffers spill (default: TMPDIR)  -
=====================================  ==========================================  =======

Other switches:

===============================  =======  ================================================
variable                         default  meaning
===============================  =======  ================================================
RESILIENT_CKPT_LOCAL_LOAD_MMAP   1        map local copies' files to load them (0: read)
RESILIENT_CKPT_READ_ONCE         1        a DCP load reads a byte range ranks share once
RESILIENT_CKPT_NVRX_ALIAS        unset    alias ``nvidia_resiliency_ext`` in every process
LOCAL_WORLD_SIZE                 -        ranks per node (``torchrun``): default replication jump
===============================  =======  ================================================

See :mod:`resilient_ckpt.local._verified_read` (mmap), :mod:`resilient_ckpt.async_ckpt._read_once`
(a reader's ``read_once=`` overrides the variable) and :mod:`resilient_ckpt.compat`.
The ``resilient_ckpt_nvrx_alias.pth`` start-up hook only tests that ``..._NVRX_ALIAS`` is
non-empty, so interpreters without it never import the package; :func:`nvrx_alias_requested`
parses the value.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from .errors import ConfigurationError

_N = TypeVar("_N", int, float)

_ENV_PREFIX = "RESILIENT_CKPT_"


@dataclass(frozen=True)
class Timeouts:
    """Deadlines (seconds) for every wait the library makes.

    ``poll_interval`` is deprecated and unused: a blocking finalize waits on the worker's
    outcome instead of polling. It is still accepted (and validated), so code that sets it
    keeps working.
    """

    worker_start: float = 120.0
    finalize: float = 1800.0
    collective: float = 1800.0
    shutdown: float = 30.0
    poll_interval: float = 0.05

    def __post_init__(self) -> None:
        for name in ("worker_start", "finalize", "collective", "shutdown", "poll_interval"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ConfigurationError(
                    f"Timeouts.{name} must be a positive number of seconds, got {value!r}"
                )


@dataclass(frozen=True)
class WorkerOptions:
    """How a persistent background worker runs (NVRx's ``PersistentAsyncCaller`` arguments)."""

    is_daemon: bool = True
    # A nice value, applied with the SCHED_BATCH policy (the worker never preempts the
    # trainer when a request wakes it). None leaves the worker's priority alone, as NVRx.
    cpu_priority: int | None = 10
    io_priority: int | None = None
    sigterm_timeout: float = 30.0
    cpu_shm_mode: bool = False

    def __post_init__(self) -> None:
        if self.cpu_priority is not None and (
            not isinstance(self.cpu_priority, int)
            or isinstance(self.cpu_priority, bool)
            or not 0 <= self.cpu_priority <= 19
        ):
            raise ConfigurationError(
                f"cpu_priority must be None or a nice value 0-19, got {self.cpu_priority!r}"
            )
        if self.io_priority is not None and self.io_priority not in (0, 1, 2, 3):
            raise ConfigurationError(
                f"io_priority must be None or an ionice class 0-3, got {self.io_priority!r}"
            )
        timeout = self.sigterm_timeout
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
            raise ConfigurationError(f"sigterm_timeout must be > 0 seconds, got {timeout!r}")


def _env_number(name: str, default: _N, kind: Callable[[str], _N], what: str) -> _N:
    """``RESILIENT_CKPT_<name>`` parsed by ``kind``; ``default`` when unset or empty."""
    raw = os.environ.get(_ENV_PREFIX + name)
    if raw is None or raw == "":
        return default
    try:
        return kind(raw)
    except ValueError as exc:
        raise ConfigurationError(
            f"environment variable {_ENV_PREFIX + name}={raw!r} is not {what}"
        ) from exc


def _env_float(name: str, default: float) -> float:
    return _env_number(name, default, float, "a number")


def _env_int(name: str, default: int) -> int:
    return _env_number(name, default, int, "an integer")


def default_timeouts() -> Timeouts:
    """The process-wide deadlines: built-in defaults overridden by environment variables."""
    base = Timeouts()
    return Timeouts(
        worker_start=_env_float("WORKER_START_TIMEOUT", base.worker_start),
        finalize=_env_float("FINALIZE_TIMEOUT", base.finalize),
        collective=_env_float("COLLECTIVE_TIMEOUT", base.collective),
        shutdown=_env_float("SHUTDOWN_TIMEOUT", base.shutdown),
        poll_interval=_env_float("POLL_INTERVAL", base.poll_interval),
    )


@dataclass(frozen=True)
class RetryPolicy:
    """Jittered exponential backoff for transient object-store errors.

    Try ``k`` (1-based) that fails transiently is followed, if tries and time remain, by a
    sleep of ``min(max_delay, base_delay * multiplier**(k-1))`` of which a ``jitter`` share
    is drawn at random (1.0 is "full jitter": uniform between 0 and the cap), so ranks that
    failed together do not retry together. ``attempts`` counts every try, the first included;
    no retry starts once ``deadline`` seconds have passed since the first try.
    """

    attempts: int = 6
    base_delay: float = 0.5
    multiplier: float = 2.0
    max_delay: float = 30.0
    jitter: float = 1.0
    deadline: float = 600.0

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, int) or isinstance(self.attempts, bool):
            raise ConfigurationError(f"RetryPolicy.attempts must be an int, got {self.attempts!r}")
        if self.attempts < 1:
            raise ConfigurationError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        for name in ("base_delay", "max_delay", "deadline"):
            value = getattr(self, name)
            if not _is_number(value) or value < 0:
                raise ConfigurationError(
                    f"RetryPolicy.{name} must be a number of seconds >= 0, got {value!r}"
                )
        if not _is_number(self.multiplier) or self.multiplier < 1:
            raise ConfigurationError(
                f"RetryPolicy.multiplier must be a number >= 1, got {self.multiplier!r}"
            )
        if not _is_number(self.jitter) or not 0 <= self.jitter <= 1:
            raise ConfigurationError(
                f"RetryPolicy.jitter must be a number in [0, 1], got {self.jitter!r}"
            )

    def backoff_cap(self, failed_attempt: int) -> float:
        """The longest sleep after try ``failed_attempt`` (1-based) failed."""
        exponent = min(failed_attempt - 1, 64)  # keeps the power finite
        return float(min(self.max_delay, self.base_delay * self.multiplier**exponent))


@dataclass(frozen=True)
class ObjectStoreOptions:
    """How an object is buffered before its upload (object stores take whole objects).

    Up to ``spool_bytes`` stay in memory; a larger object spills to a temporary file in
    ``spool_dir`` (the system default when None) and is uploaded from there, in parts.
    """

    spool_bytes: int = 256 << 20
    spool_dir: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.spool_bytes, int) or isinstance(self.spool_bytes, bool):
            raise ConfigurationError(
                f"ObjectStoreOptions.spool_bytes must be an int, got {self.spool_bytes!r}"
            )
        if self.spool_bytes < 0:
            raise ConfigurationError(
                f"ObjectStoreOptions.spool_bytes must be >= 0, got {self.spool_bytes}"
            )
        if self.spool_dir is not None and not os.path.isdir(self.spool_dir):
            raise ConfigurationError(
                f"ObjectStoreOptions.spool_dir {self.spool_dir!r} is not a directory "
                f"(set {_ENV_PREFIX}MSC_SPOOL_DIR to an existing one, or unset it)"
            )


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def default_retry_policy() -> RetryPolicy:
    """The process-wide retry policy: defaults overridden by ``RESILIENT_CKPT_RETRY_*``."""
    base = RetryPolicy()
    return RetryPolicy(
        attempts=_env_int("RETRY_ATTEMPTS", base.attempts),
        base_delay=_env_float("RETRY_BASE_DELAY", base.base_delay),
        multiplier=_env_float("RETRY_MULTIPLIER", base.multiplier),
        max_delay=_env_float("RETRY_MAX_DELAY", base.max_delay),
        jitter=_env_float("RETRY_JITTER", base.jitter),
        deadline=_env_float("RETRY_DEADLINE", base.deadline),
    )


def default_object_store_options() -> ObjectStoreOptions:
    """Upload buffering from ``RESILIENT_CKPT_MSC_SPOOL_BYTES`` / ``..._MSC_SPOOL_DIR``."""
    base = ObjectStoreOptions()
    return ObjectStoreOptions(
        spool_bytes=_env_int("MSC_SPOOL_BYTES", base.spool_bytes),
        spool_dir=os.environ.get(_ENV_PREFIX + "MSC_SPOOL_DIR") or None,
    )


def local_world_size() -> int | None:
    """Ranks per node from ``LOCAL_WORLD_SIZE`` (torchrun, Slurm wrappers); None if unset."""
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError as exc:
        raise ConfigurationError(f"LOCAL_WORLD_SIZE={raw!r} is not an integer") from exc
    if value < 1:
        raise ConfigurationError(f"LOCAL_WORLD_SIZE must be >= 1, got {value}")
    return value


NVRX_ALIAS_ENV = _ENV_PREFIX + "NVRX_ALIAS"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def nvrx_alias_requested() -> bool:
    """Whether ``RESILIENT_CKPT_NVRX_ALIAS`` asks for the ``nvidia_resiliency_ext`` alias."""
    raw = os.environ.get(NVRX_ALIAS_ENV, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigurationError(
        f"environment variable {NVRX_ALIAS_ENV}={raw!r} is not a switch: use 1 to alias "
        f"nvidia_resiliency_ext.checkpointing to resilient_ckpt, 0 or unset for no alias"
    )


def request_nvrx_alias_in_children() -> None:
    """Set ``RESILIENT_CKPT_NVRX_ALIAS=1`` so interpreters started from here alias too."""
    os.environ[NVRX_ALIAS_ENV] = "1"


def local_load_mmap() -> bool:
    """Whether local checkpoint copies are loaded through a file mapping (the default)."""
    raw = os.environ.get(_ENV_PREFIX + "LOCAL_LOAD_MMAP", "1").strip().lower()
    if raw in ("1", "true", "yes", "on", ""):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ConfigurationError(
        f"environment variable {_ENV_PREFIX}LOCAL_LOAD_MMAP={raw!r} must be 1 or 0"
    )


def read_once_enabled() -> bool:
    """Whether DCP loads through the library's readers read each shared byte once (the
    default); ``RESILIENT_CKPT_READ_ONCE=0`` turns it off."""
    raw = os.environ.get(_ENV_PREFIX + "READ_ONCE", "1").strip().lower()
    if raw in _TRUE or raw == "":
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ConfigurationError(
        f"environment variable {_ENV_PREFIX}READ_ONCE={raw!r} must be 1 (each stored byte read "
        "once across ranks) or 0 (every rank reads all it needs)"
    )


def otel_environment() -> dict[str, str]:
    """OpenTelemetry's standard ``OTEL_*`` variables: the checkpoint worker decides from them
    whether to export its spans, and how (see :mod:`resilient_ckpt._telemetry`); the SDK's
    exporters read them too."""
    return {key: value for key, value in os.environ.items() if key.startswith("OTEL_")}
