"""Rank-prefixed logging without touching the root logger.

Modules call :func:`get_logger` (a thin wrapper over ``logging.getLogger(__name__)``); the
adapter adds ``[rank N]`` to each message, reading the rank lazily so a logger created at
import time still shows the rank once the process group exists.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

from . import _rank


def _process_rank() -> int | None:
    """This process's rank once a process group exists (no prefix before)."""
    return _rank.rank() if _rank.has_process_group() else None


class RankAdapter(logging.LoggerAdapter):  # type: ignore[type-arg]
    """Prefixes every message with the process's rank (or ``[worker of rank N]``)."""

    role: str = "rank"
    fixed_rank: int | None = None

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        rank = RankAdapter.fixed_rank if RankAdapter.fixed_rank is not None else _process_rank()
        if rank is None:
            return msg, kwargs
        return f"[{RankAdapter.role} {rank}] {msg}", kwargs


def get_logger(name: str) -> RankAdapter:
    return RankAdapter(logging.getLogger(name), {})


def set_worker_identity(rank: int | None) -> None:
    """Called in a background worker so its log lines say whose worker it is."""
    RankAdapter.role = "worker of rank"
    RankAdapter.fixed_rank = rank
