"""Cross-rank agreement on async requests, over a process group the library owns.

Decision: every agreement is an ``all_gather`` of a three-integer record per rank
``(state, call_idx, deadline_passed)`` on a *gloo* group created by the library. So the
check works the same in CPU-only and GPU jobs, never touches CUDA, and never interleaves
with the user's NCCL collectives. Because every rank sees every rank's record, every rank
takes the same decision (finalize, keep waiting, raise) and the collectives stay in step.

The group is created lazily, by ``dist.new_group``, which is itself collective: it happens
inside the first ``maybe_finalize_async_calls(no_dist=False)``, which every rank calls at
once anyway. Its timeout is the configured collective deadline, so a rank that vanished
makes the others fail instead of waiting forever.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .._logging import get_logger

logger = get_logger(__name__)


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


_groups: dict[int, Any] = {}


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def library_group(collective_timeout: float) -> Any:
    """The library's gloo group over all ranks (created on first use, then cached).

    One group per default process group: the first caller's deadline becomes its timeout.
    """
    key = id(dist.group.WORLD)
    group = _groups.get(key)
    if group is None:
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=collective_timeout))
        _groups.clear()
        _groups[key] = group
        logger.debug("created library gloo group (timeout %.0fs)", collective_timeout)
    return group


def exchange(
    state: State, call_idx: int, deadline_passed: bool, collective_timeout: float
) -> list[RankRecord]:
    """Every rank's record, in rank order (just this rank's when not distributed)."""
    if not is_distributed():
        return [
            RankRecord(
                0 if not dist.is_initialized() else dist.get_rank(),
                state,
                call_idx,
                deadline_passed,
            )
        ]
    group = library_group(collective_timeout)
    mine = torch.tensor([int(state), int(call_idx), int(deadline_passed)], dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine, group=group)
    return [RankRecord(r, State(int(t[0])), int(t[1]), bool(t[2])) for r, t in enumerate(gathered)]


def gather_objects(obj: Any, collective_timeout: float) -> list[Any]:
    """``all_gather_object`` over the library group (only used on the failure path)."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=library_group(collective_timeout))
    return out


def max_int(value: int, collective_timeout: float) -> int:
    if not is_distributed():
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=library_group(collective_timeout))
    return int(t.item())


def barrier(collective_timeout: float) -> None:
    if is_distributed():
        dist.barrier(group=library_group(collective_timeout))


def my_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
