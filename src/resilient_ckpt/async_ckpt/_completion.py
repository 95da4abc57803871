"""Cross-rank completion of async requests: one record per rank, one decision everywhere.

Decision: each poll is one :func:`resilient_ckpt._dist.agree` over the library's gloo group,
carrying a three-integer record per rank ``(state, call_idx, deadline_passed)`` and this
rank's error if its request failed. Because every rank sees every rank's record, every rank
takes the same decision (finalize, keep waiting, raise) and the collectives stay in step; a
failure on any rank is raised on every rank by the agreement itself.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from .. import _dist


class State(enum.IntEnum):
    RUNNING = 0
    DONE = 1
    FAILED = 2


@dataclass(frozen=True)
class RankRecord:
    rank: int
    state: State
    call_idx: int
    deadline_passed: bool


def exchange(
    state: State,
    call_idx: int,
    deadline_passed: bool,
    collective_timeout: float,
    *,
    error: BaseException | None = None,
    local_only: bool = False,
    details: dict[str, Any] | None = None,
) -> list[RankRecord]:
    """Every rank's record, in rank order (just this rank's with ``local_only`` or when not
    distributed). Raises the agreed error on every rank when ``error`` is set on any."""
    outcomes = _dist.agree(
        f"async request {call_idx}",
        error,
        ints=(int(state), int(call_idx), int(deadline_passed)),
        local_only=local_only or not _dist.is_distributed(),
        timeout=collective_timeout,
        details=details,
    )
    return [RankRecord(o.rank, State(o.ints[0]), o.ints[1], bool(o.ints[2])) for o in outcomes]
