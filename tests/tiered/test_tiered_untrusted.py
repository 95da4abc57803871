"""The tiered restore given files it must not trust, on two ranks (one clique {0, 1}).

Commit records are never unpickled freely: a memory-tier record built to run code is
refused (its marker never appears, the refusal is logged with the file and the global)
and treated as unavailable; the copy of the record on the other rank serves, and with
every copy refused the restore falls back to the next newest step.

``weights_only=True`` (the safe mode): the state's non-tensor values are loaded with
``torch.load(weights_only=True)``. A value of a class not marked safe fails ``load`` on
every rank with ``UnsafeCheckpointError`` naming it (no silent fall back to an older
step); inside ``torch.serialization.safe_globals`` the same checkpoint loads exactly.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
from typing import Any

import pytest
import torch.distributed as dist

from resilient_ckpt.errors import UnsafeCheckpointError
from resilient_ckpt.testing import launch
from tests._helpers import RunsCode, safe_globals

from ._app import App, reference, same, train
from ._jobs import manager, run

pytestmark = [pytest.mark.dist]


@dataclasses.dataclass
class Schedule:
    warmup: int


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        logging.getLogger("resilient_ckpt").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _record(root: str, owner: int, step: int) -> str:
    return os.path.join(root, "mem", str(owner), f"step_{step:09d}", ".metadata")


def _poison(path: str, marker: str) -> None:
    """Replace a commit record by itself with a code-running object tucked inside."""
    with open(path, "rb") as f:
        metadata = pickle.load(f)
    metadata.planner_data = {"x": RunsCode(marker)}
    with open(path, "wb") as f:
        pickle.dump(metadata, f)


def _restore(root: str, **kwargs: Any) -> dict[str, Any]:
    app = App()
    mgr = manager(root, replication_jump=1, **kwargs)
    try:
        step = mgr.load(app.checkpoint())
        facts: dict[str, Any] = {"step": step}
        if step is not None:
            facts["tier"] = mgr.last_restore["tier"]
            facts["exact"] = same(app.snapshot(), reference(step))
        return facts
    finally:
        mgr.close()


def _ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    facts: dict[str, Any] = {}
    log = _Warnings()
    marker = os.path.join(root, "ran")
    mgr = manager(root, replication_jump=1, weights_only=True)
    run(mgr, App(), range(1, 4))  # step 2 durable; memory keeps 2 and 3
    mgr.maybe_finalize(blocking=True)
    mgr.close()
    facts["plain"] = _restore(root, weights_only=True)
    # 1. rank 0's copy of the step 3 record runs code: refused, rank 1's copy serves
    dist.barrier()
    if rank == 0:
        _poison(_record(root, 0, 3), marker)
    dist.barrier()
    facts["one_poisoned"] = _restore(root)
    # 2. every copy poisoned: step 3 is unavailable, memory step 2 is restored
    dist.barrier()
    if rank == 1:
        _poison(_record(root, 1, 3), marker)
    dist.barrier()
    facts["all_poisoned"] = _restore(root)
    facts["warnings"] = list(log.messages)
    # 3. safe mode and a user's class among the values (saved as step 4, after step 2)
    app = App()
    mgr = manager(root, replication_jump=1, weights_only=True)
    assert mgr.load(app.checkpoint()) == 2
    app.extra["schedule"] = Schedule(5)
    for step in (3, 4):
        train(app, step)
    mgr.save(app.checkpoint(), 4)
    mgr.maybe_finalize(blocking=True)
    mgr.close()
    try:
        _restore_with_schedule(root)
    except UnsafeCheckpointError as exc:
        facts["refused"] = (type(exc).__name__, exc.name, str(exc).splitlines()[0])
    with safe_globals([Schedule]):
        facts["allowed"] = _restore_with_schedule(root)
    dist.barrier()
    facts["ran"] = os.path.exists(marker)
    return facts


def _restore_with_schedule(root: str) -> dict[str, Any]:
    app = App()
    app.extra["schedule"] = None
    mgr = manager(root, replication_jump=1, weights_only=True)
    try:
        step = mgr.load(app.checkpoint())
        schedule = app.extra.pop("schedule")
        return {"step": step, "schedule": schedule, "exact": same(app.snapshot(), reference(4))}
    finally:
        mgr.close()


@pytest.mark.timeout(400)
def test_tiered_restore_of_untrusted_files(tmp_path):
    root = str(tmp_path)
    results = launch(_ranks, 2, root, timeout=300)
    for rank, facts in enumerate(results):
        assert facts["plain"] == {"step": 3, "tier": "memory", "exact": True}
        assert facts["one_poisoned"] == {"step": 3, "tier": "memory", "exact": True}
        assert facts["all_poisoned"] == {"step": 2, "tier": "memory", "exact": True}
        refusal = f"refused commit record {_record(root, rank, 3)}: it names the global posix.mkdir"
        assert any(refusal in m for m in facts["warnings"]), facts["warnings"]
        kind, name, first_line = facts["refused"]
        assert kind == "RankUnsafeCheckpointError" and name.endswith("Schedule"), facts
        assert "restoring memory step 4 (weights_only=True) failed on rank(s) [0, 1]" in first_line
        assert "value 'extra.schedule'" in first_line
        assert facts["allowed"] == {"step": 4, "schedule": Schedule(5), "exact": True}
        assert facts["ran"] is False
