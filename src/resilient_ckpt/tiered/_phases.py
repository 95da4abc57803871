"""The named points of a tiered save, reported to ``on_phase`` hooks (and the fault kit).

In order, per save: ``STAGED`` (trainer: the snapshot is taken, ``save`` is returning),
``MEMORY_WRITTEN`` (replicator thread: every rank's memory-tier files are written),
``REPLICATED`` (every replica is stored, nothing committed yet), ``MEMORY_COMMITTED``
(this rank's commit record is written), ``DURABLE_COMMITTED`` (trainer, durable saves only,
from ``maybe_finalize``: ``.metadata`` is written). A hook that kills the process at one of
them simulates a crash at exactly that point.
"""

from __future__ import annotations

import enum
from collections.abc import Callable


class TieredPhase(str, enum.Enum):
    STAGED = "staged"
    MEMORY_WRITTEN = "memory_written"
    REPLICATED = "replicated"
    MEMORY_COMMITTED = "memory_committed"
    DURABLE_COMMITTED = "durable_committed"


PhaseHook = Callable[[TieredPhase, int], None]
