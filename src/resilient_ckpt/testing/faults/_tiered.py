"""Faults aimed at a :class:`~resilient_ckpt.tiered.TieredCheckpointManager`'s phases.

* :func:`kill_at_tiered_phase`: SIGKILL this trainer when one of its saves reaches a
  :class:`~resilient_ckpt.tiered.TieredPhase` (after the snapshot, after the memory write,
  after the replicas, after the memory or durable commit), on chosen ranks and steps.
* :class:`FaultyTieredCheckpointManager`: the worker's writes of both tiers run under
  storage/call :class:`~._plan.Fault` values (``Action.KILL`` at ``Phase.WRITE`` with
  ``after_bytes``: the worker dies mid-write; ``Action.RAISE`` with ``errno=ENOSPC``: a full
  tier). The manager's ``queue`` also works with :func:`~._kill.kill_during_save`.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable, Sequence
from typing import Any

from ...async_ckpt.core import AsyncRequest
from ...tiered import TieredCheckpointManager, TieredPhase
from ._plan import Fault, as_faults, current_rank
from ._storage import faulty_request


def kill_at_tiered_phase(
    manager: TieredCheckpointManager,
    phase: TieredPhase | str,
    *,
    steps: Iterable[int] | None = None,
    ranks: Iterable[int] | None = None,
) -> None:
    """Make ``manager`` SIGKILL its own process at ``phase`` of the saves of ``steps``
    (None: any) on ``ranks`` (None: every rank). Chains any hook already installed."""
    wanted = TieredPhase(phase)
    step_set = None if steps is None else set(steps)
    rank_set = None if ranks is None else set(ranks)
    previous = manager.on_phase

    def hook(at: TieredPhase, step: int) -> None:
        previous(at, step)
        if at != wanted or (step_set is not None and step not in step_set):
            return
        if rank_set is not None and current_rank() not in rank_set:
            return
        os.kill(os.getpid(), signal.SIGKILL)

    manager.on_phase = hook


class FaultyTieredCheckpointManager(TieredCheckpointManager):
    """A tiered manager whose background writes (both tiers) run under ``faults``.

    Assign ``manager.faults`` to change them between saves.
    """

    def __init__(self, *args: Any, faults: Fault | Sequence[Fault] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.faults = as_faults(faults)

    def _background_request(self, request: AsyncRequest) -> AsyncRequest:
        if not self.faults:
            return request
        return faulty_request(request, self.faults, self.rank)
