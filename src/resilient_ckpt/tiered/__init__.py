"""Tiered checkpointing: one snapshot -> memory tier with peer replicas + durable drain.

See :class:`TieredCheckpointManager` for the call protocol; the modules' docstrings record
the decisions (layout, background writes, replication and commit, restore, reader).
"""

from ._phases import TieredPhase
from .manager import TieredCheckpointManager

__all__ = ["TieredCheckpointManager", "TieredPhase"]
