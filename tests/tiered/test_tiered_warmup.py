"""``TieredCheckpointManager.warmup`` (issue 13's "no cold first save" for the tiered flow):
after it the worker runs before the first save, which restores bit-exact; the warm-up
itself writes nothing to either tier. (That the first save reuses the warm-up's plan is in
``tests/unit/test_performance_contract.py``.)"""

from __future__ import annotations

import pytest

from resilient_ckpt.testing import launch

from ._jobs import warmed_up

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]


def test_warmup_starts_the_worker_and_the_first_save_restores_exactly(tmp_path) -> None:
    for rank, facts in enumerate(launch(warmed_up, 2, str(tmp_path))):
        assert facts["worker_up"], f"rank {rank}: no worker after warmup"
        assert facts["nothing_written"], f"rank {rank}: warmup wrote to the durable tier"
        restored = facts["restore"]
        assert restored["step"] == 1 and restored["exact"], (rank, restored)
