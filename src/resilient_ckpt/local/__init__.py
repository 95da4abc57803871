"""Local checkpoints: per-rank files on node-local storage, replicated across nodes.

``LocalCheckpointManager(root).save(BasicTensorAwareStateDict(state), iteration)`` writes
this rank's shard; ``find_latest()`` and ``load()`` bring back the newest complete one,
fetching shards whose files are missing or corrupt from replication peers.
"""

from ..errors import NoReplicasAvailableError, SameMachineReplicationException
from .base_state_dict import TensorAwareStateDict
from .basic_state_dict import BasicTensorAwareStateDict
from .ckpt_managers.base_manager import BaseCheckpointManager, CheckpointingException
from .ckpt_managers.local_manager import LocalCheckpointManager
from .replication.strategies import (
    CliqueReplicationStrategy,
    LazyCliqueReplicationStrategy,
    ReplicationStrategy,
)

__all__ = [
    "BaseCheckpointManager",
    "BasicTensorAwareStateDict",
    "CheckpointingException",
    "CliqueReplicationStrategy",
    "LazyCliqueReplicationStrategy",
    "LocalCheckpointManager",
    "NoReplicasAvailableError",
    "ReplicationStrategy",
    "SameMachineReplicationException",
    "TensorAwareStateDict",
]
