"""Fault injection for checkpointing tests: storage faults, kills, corrupt files, full disks.

Shipped with the package so that users can run their own checkpointing code through the
same faults as our test matrix (``tests/fault``). Everything here works in multi-process
jobs: faults are picklable values that name the ranks they fire on and travel with a
request into the background worker, where the I/O happens.

* Storage faults: :class:`Fault` (a :class:`Phase`, an :class:`Action`, ranks, a file name
  pattern) fired by :class:`FaultyBackend`, which wraps any storage backend. Use them through
  :class:`FaultyWriter` (async DCP), :class:`FaultyLocalCheckpointManager`,
  :func:`faulty_request` (any ``AsyncRequest``) or ``with inject(...)`` (this process).
* Tiered: :func:`kill_at_tiered_phase` (SIGKILL the trainer at a phase of a tiered save),
  :class:`FaultyTieredCheckpointManager` (the worker's writes of both tiers under faults).
* Kills: :func:`kill_after`, :func:`kill_during_save` (trainer or worker, random point),
  :func:`worker_pids`, :func:`descendants`, :func:`wait_gone`; or ``Action.KILL`` at an exact
  phase.
* Files: :func:`flip_byte`, :func:`truncate`; :func:`small_filesystem` (a size-limited
  ``tmpfs``, raising :class:`MountUnavailable` with the reason where mounting is not
  allowed) and :func:`fill_filesystem`.

Example: rank 1's first data file fails half-way with "no space left on device"::

    writer = FaultyWriter(path, faults=[Fault(Phase.WRITE, Action.RAISE, ranks=[1],
                                              match="*.distcp", after_bytes=4096,
                                              errno=errno.ENOSPC)])
"""

from ._disk import (
    MountUnavailable,
    fill_filesystem,
    flip_byte,
    free_bytes,
    small_filesystem,
    truncate,
)
from ._kill import (
    KillTimer,
    descendants,
    is_alive,
    kill_after,
    kill_during_save,
    wait_gone,
    worker_pids,
)
from ._plan import Action, Fault, InjectedFault, Injector, Phase, current_rank
from ._storage import (
    FaultyBackend,
    FaultyCall,
    FaultyLocalCheckpointManager,
    FaultyWriter,
    faulty_request,
    inject,
)
from ._tiered import FaultyTieredCheckpointManager, kill_at_tiered_phase

__all__ = [
    "Action",
    "Fault",
    "FaultyBackend",
    "FaultyCall",
    "FaultyLocalCheckpointManager",
    "FaultyTieredCheckpointManager",
    "FaultyWriter",
    "InjectedFault",
    "Injector",
    "KillTimer",
    "MountUnavailable",
    "Phase",
    "current_rank",
    "descendants",
    "faulty_request",
    "fill_filesystem",
    "flip_byte",
    "free_bytes",
    "inject",
    "is_alive",
    "kill_after",
    "kill_at_tiered_phase",
    "kill_during_save",
    "small_filesystem",
    "truncate",
    "wait_gone",
    "worker_pids",
]
