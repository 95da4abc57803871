"""Memory-tier restore across nodes. Two simulated nodes with separate memory directories
(``mem/nodeA`` for ranks 0-1, ``mem/nodeB`` for ranks 2-3, as node-local ``/dev/shm`` would
be), cliques {0, 2} and {1, 3}, so every shard has a copy on the other node. Node B is lost
(its directory deleted) and the job restarts: ranks 2 and 3 see nothing locally, receive
their shards from ranks 0 and 1 over the process group, and resume bit-exact from memory.
With node B lost and node A's copy of rank 2's newest shard corrupt, the newest step cannot
be restored by anyone: every rank falls back to the older memory step together."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist

from resilient_ckpt.testing import launch
from resilient_ckpt.tiered import TieredCheckpointManager

pytestmark = [pytest.mark.dist]


def _value(rank: int, step: int) -> torch.Tensor:
    return torch.arange(4096, dtype=torch.float32) * (rank + 1) + step


def _manager(root: str, rank: int) -> TieredCheckpointManager:
    node = "nodeA" if rank < 2 else "nodeB"
    return TieredCheckpointManager(
        os.path.join(root, "mem", node),
        os.path.join(root, "durable"),
        replication_factor=2,
        replication_jump=2,
        durable_every=1000,  # nothing durable: a restore can only come from memory
        keep_memory=2,
    )


def _save(mgr: TieredCheckpointManager, rank: int, steps: range) -> None:
    for step in steps:
        mgr.save({f"rank{rank}.w": _value(rank, step)}, step)
        mgr.maybe_finalize(blocking=True)


def _lose_node_b(root: str, rank: int) -> None:
    dist.barrier()
    if rank == 2:
        shutil.rmtree(os.path.join(root, "mem", "nodeB"))
    dist.barrier()


def _restore(root: str, rank: int) -> dict:
    mgr = _manager(root, rank)
    into = {f"rank{rank}.w": torch.zeros(4096)}
    step = mgr.load(into)
    facts = dict(mgr.last_restore or {})
    facts["exact"] = step is not None and torch.equal(into[f"rank{rank}.w"], _value(rank, step))
    facts["returned"] = step
    return facts | {"mgr": mgr}


def _job(rank: int, world: int, root: str) -> dict:
    mgr = _manager(root, rank)
    _save(mgr, rank, range(1, 4))
    mgr.close()
    _lose_node_b(root, rank)
    if rank == 0:  # node A's copy of rank 2's newest shard goes bad as well
        path = os.path.join(root, "mem", "nodeA", "0", "step_000000003", "__2_0.distcp")
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    fallback = _restore(root, rank)
    _save(fallback.pop("mgr"), rank, range(3, 6))  # resumes from step 2: steps 3-5 again
    _lose_node_b(root, rank)
    latest = _restore(root, rank)
    latest.pop("mgr").close()
    return {"fallback": fallback, "latest": latest}


@pytest.mark.timeout(240)
def test_replaced_node_restores_from_peer_nodes_over_the_group(tmp_path) -> None:
    results = launch(_job, 4, str(tmp_path), timeout=200)
    for rank, facts in enumerate(results):
        fallback, latest = facts["fallback"], facts["latest"]
        assert (fallback["step"], fallback["tier"], fallback["exact"]) == (2, "memory", True)
        assert (latest["step"], latest["tier"], latest["exact"]) == (5, "memory", True)
        for restore in (fallback, latest):
            own = f"__{rank}_0.distcp"
            if rank >= 2:  # node B: its own shard came from its clique peer on node A
                assert restore["files"][own] == f"rank {rank - 2}", restore["files"]
            else:
                assert restore["files"][own].startswith(str(tmp_path)), restore["files"]
