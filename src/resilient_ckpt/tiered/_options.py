"""Validated configuration of a :class:`~.manager.TieredCheckpointManager`."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import ConfigurationError
from ..storage.base import is_msc_url, is_url


def _positive_int(name: str, value: object, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigurationError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class TieredOptions:
    """Every option of a tiered manager; invalid values raise ``ConfigurationError``.

    ``memory_dir`` must be a local path (node-local RAM, e.g. ``/dev/shm/<job>``);
    ``durable_dir`` a path on shared storage or an ``msc://profile/prefix`` URL.
    """

    memory_dir: str
    durable_dir: str
    replication_factor: int = 2
    replication_jump: int | None = None
    durable_every: int = 10
    keep_memory: int = 2
    keep_durable: int = 2
    thread_count: int = 1
    durable_sync: bool = True
    weights_only: bool = False

    def __post_init__(self) -> None:
        for name in ("memory_dir", "durable_dir"):
            value = getattr(self, name)
            if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
                raise ConfigurationError(f"{name} must be a non-empty path, got {value!r}")
        if is_url(os.fspath(self.memory_dir)):
            raise ConfigurationError(
                f"memory_dir must be a node-local path (e.g. /dev/shm/<job>), got "
                f"{self.memory_dir!r}"
            )
        durable = os.fspath(self.durable_dir)
        if is_url(durable) and not is_msc_url(durable):
            raise ConfigurationError(
                f"durable_dir must be a path or an msc://profile/prefix URL, got {durable!r}"
            )
        _positive_int("replication_factor", self.replication_factor)
        if self.replication_jump is not None:
            _positive_int("replication_jump", self.replication_jump)
        for name in ("durable_every", "keep_memory", "keep_durable", "thread_count"):
            _positive_int(name, getattr(self, name))
        for name in ("durable_sync", "weights_only"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigurationError(f"{name} must be a bool, got {getattr(self, name)!r}")
