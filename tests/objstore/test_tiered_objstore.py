"""Tiered checkpointing with its durable tier on an object store (``msc://``, moto S3).

One 2-rank launch: saves 1-3 with every 2nd save durable (step 2 goes to the store through
the msc backend, ``.metadata`` last), then every memory directory is lost and a fresh
manager restores step 2 from the store, verified and bit-exact.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch.distributed as dist

from resilient_ckpt.testing.launcher import launch

pytestmark = [pytest.mark.objstore, pytest.mark.dist]


def _tiered_on_store(rank: int, world: int, memory_dir: str, durable_url: str) -> dict:
    from resilient_ckpt.storage import get_backend
    from resilient_ckpt.tiered import TieredCheckpointManager
    from tests.tiered._app import App, reference, same, train

    def manager() -> TieredCheckpointManager:
        return TieredCheckpointManager(
            memory_dir, durable_url, replication_factor=2, replication_jump=1, durable_every=2
        )

    mgr, app = manager(), App()
    for step in range(1, 4):
        train(app, step)
        mgr.save(app.checkpoint(), step)
        mgr.maybe_finalize()
    mgr.close()
    backend = get_backend(durable_url)
    committed = backend.exists(backend.join(durable_url, "step_000000002", ".metadata"))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(memory_dir)
    dist.barrier()
    fresh, mgr = App(), manager()
    step = mgr.load(fresh.checkpoint())
    facts = {
        "committed": committed,
        "step": step,
        "tier": mgr.last_restore["tier"] if step else None,
        "exact": step is not None and same(fresh.snapshot(), reference(step)),
    }
    mgr.close()
    return facts


@pytest.mark.timeout(300)
def test_durable_tier_on_object_store(s3_store, tmp_path):
    memory_dir = os.path.join(str(tmp_path), "mem")
    facts = launch(_tiered_on_store, 2, memory_dir, s3_store.url("tiered"), timeout=240)
    for f in facts:
        assert f == {"committed": True, "step": 2, "tier": "durable", "exact": True}, f
