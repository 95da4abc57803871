"""Deadlines and tunables, and the one place where environment variables are read.

Every wait in the library has a deadline taken from a :class:`Timeouts` value. The defaults
suit a real job (a slow parallel file system can take minutes to write a large checkpoint);
tests and impatient users shrink them either per object (the ``timeouts=`` keyword on
queues and callers) or process-wide with the environment variables below, read once per
call of :func:`default_timeouts` so a test can change them with ``monkeypatch``.

=====================================  ==========================================  =======
variable                               meaning                                     default
=====================================  ==========================================  =======
RESILIENT_CKPT_WORKER_START_TIMEOUT    worker spawn + handshake                    120 s
RESILIENT_CKPT_FINALIZE_TIMEOUT        blocking wait for a request, all ranks      1800 s
RESILIENT_CKPT_COLLECTIVE_TIMEOUT      the library's gloo group collectives        1800 s
RESILIENT_CKPT_SHUTDOWN_TIMEOUT        close(): drain before terminate/kill        30 s
RESILIENT_CKPT_POLL_INTERVAL           sleep between polls of a blocking wait      0.05 s
=====================================  ==========================================  =======

:func:`local_world_size` reads the launcher's ``LOCAL_WORLD_SIZE`` (ranks per node, set by
``torchrun``), which sizes the default replication jump of local checkpoints.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import ConfigurationError

_ENV_PREFIX = "RESILIENT_CKPT_"


@dataclass(frozen=True)
class Timeouts:
    """Deadlines (seconds) for every wait the library makes."""

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
    cpu_priority: int = 10
    io_priority: int | None = None
    sigterm_timeout: float = 30.0
    cpu_shm_mode: bool = False

    def __post_init__(self) -> None:
        if (
            not isinstance(self.cpu_priority, int)
            or isinstance(self.cpu_priority, bool)
            or not 0 <= self.cpu_priority <= 19
        ):
            raise ConfigurationError(
                f"cpu_priority must be a nice value 0-19, got {self.cpu_priority!r}"
            )
        if self.io_priority is not None and self.io_priority not in (0, 1, 2, 3):
            raise ConfigurationError(
                f"io_priority must be None or an ionice class 0-3, got {self.io_priority!r}"
            )
        timeout = self.sigterm_timeout
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
            raise ConfigurationError(f"sigterm_timeout must be > 0 seconds, got {timeout!r}")


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(_ENV_PREFIX + name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError as exc:
        raise ConfigurationError(
            f"environment variable {_ENV_PREFIX + name}={raw!r} is not a number of seconds"
        ) from exc


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
