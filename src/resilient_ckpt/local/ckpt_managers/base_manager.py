"""``BaseCheckpointManager``: the protocol of local checkpoints, independent of storage.

Public methods own the invariants; a subclass implements the storage ``_hooks`` (listing,
reading and verifying copies, the write function, commit, retention). Every public method
is collective: all ranks call it at once, in the trainer.

* ``save(state, iteration, is_async)``: every rank checks the request locally (a
  TensorAwareStateDict, an iteration newer than any known, a writable directory, a
  picklable non-tensor part) and the outcomes are agreed, so a bad request fails on every
  rank with the cause instead of hanging the others. The shard is laid out once. Without
  replication, writing it is the ``async_fn`` of an
  :class:`~resilient_ckpt.async_ckpt.core.AsyncRequest` that runs on the persistent queue
  (which snapshots the tensors into shared memory) and on the fork queue (which snapshots
  by forking, after ``preload_fn`` moved device tensors to the host). With replication the
  shard is serialized into one flat buffer (the snapshot) and exchanged with the clique,
  which is a collective and so happens in the trainer: in a trainer thread for async saves
  over gloo (the request's ``async_fn`` waits for that thread, see ``.._background``),
  inline otherwise. The finalize function commits: once every rank's writes succeeded,
  each rank renames its dirty files to their final names, and retention removes older
  iterations (in the background, see ``.._deleter``). A synchronous save runs the same
  steps inline.
* ``find_latest()``: all ranks gather the catalogue of committed copies. Newest first, an
  iteration is complete when every rank's shard has a copy whose checksum verifies: each
  rank verifies its own copy (reading it, which also pre-loads it for ``load``); for
  shards whose owner has no valid copy, the holders of replicas verify theirs. A corrupt
  file is logged by path and treated as missing. Newer iterations that are not complete are
  deleted (they can never become complete), as are dirty leftovers of interrupted saves.
* ``load()``: the strategy plans who sends which shard (only ranks without a valid copy
  of their own receive one), the verified bytes move as one buffer per transfer, and the
  state is rebuilt with its tensors as views of that buffer, then moved back to the
  devices it came from.
"""

from __future__ import annotations

from ...errors import CheckpointingException, SameMachineReplicationException
from ._manager_base import CkptID
from ._restore import RestoreSteps
from ._save import SaveSteps

__all__ = [
    "BaseCheckpointManager",
    "CheckpointingException",
    "CkptID",
    "SameMachineReplicationException",
]


class BaseCheckpointManager(RestoreSteps, SaveSteps):
    """Local checkpoints of one rank's state, with optional replication (NVRx API).

    The public methods (``find_latest``, ``load``, ``save``; all collective) come from
    :class:`~._restore.RestoreSteps` and :class:`~._save.SaveSteps`; a subclass
    implements the storage hooks of :class:`~._manager_base.ManagerBase`.
    """
