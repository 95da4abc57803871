"""Lightning tiered mode: a 2-rank DDP Trainer (CPU, gloo) SIGKILLed, a node lost, resumed.

The job (``lightning_job.py --tiered``) saves every step to the memory tier (each rank's
shard also on the other rank, standing for the other node) and every 5th step to the
durable tier, and both ranks SIGKILL themselves at step 17. Rank 0's memory directory is
deleted before the restart. The resumed ``fit`` (no ``ckpt_path``) must restore from the
memory tier (so rank 0's shard from its peer's copy; the memory tier is preferred when at
least as new as durable) and end with the weights of an uninterrupted run, bit for bit
(computed in-process as in ``test_lightning.py``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from .test_lightning import JOB, STEPS, _uninterrupted_weights

pytestmark = [
    pytest.mark.dist,
    pytest.mark.fault,
    pytest.mark.skipif(
        importlib.util.find_spec("lightning") is None, reason="needs the lightning extra"
    ),
]

CRASH_AT, DURABLE_EVERY = 17, 5


def _torchrun(workdir: str, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [JOB, "--tiered", "--workdir", workdir, "--steps", str(STEPS)]
    cmd += ["--durable-every", str(DURABLE_EVERY), "--step-time", "0.02", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200)


@pytest.mark.timeout(300)
def test_killed_ddp_trainer_resumes_from_the_memory_tier(tmp_path) -> None:
    work = str(tmp_path / "job")
    killed = _torchrun(work, "--crash-at", str(CRASH_AT))
    assert killed.returncode != 0, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert not os.path.exists(os.path.join(work, "final.pt"))
    memory = os.path.join(work, "memory")
    assert os.path.isdir(os.path.join(memory, "0")), os.listdir(memory)
    # Rank 0's node is gone with its RAM. (DDP's weights are replicated, so DCP's planner
    # has rank 0 write them all: its shard is the one that matters.)
    shutil.rmtree(os.path.join(memory, "0"))

    resumed = _torchrun(work)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    with open(os.path.join(work, "summary.json")) as f:
        summary = json.load(f)
    source = summary["resumed_from"]
    assert source is not None, summary
    # Rank 0's files came from rank 1's copies: the memory tier served the restore.
    assert source["tier"] == "memory" and 0 < source["step"] <= CRASH_AT, summary
    assert summary["global_step"] == STEPS

    final = torch.load(os.path.join(work, "final.pt"))
    reference = _uninterrupted_weights()
    assert final.keys() == reference.keys()
    for key in reference:
        assert torch.equal(final[key], reference[key]), key
