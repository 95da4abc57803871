"""Lightning integration: a 2-rank DDP Trainer (CPU, gloo) SIGKILLed mid-run, then resumed.

The job (``lightning_job.py``) runs under ``torchrun``; both ranks SIGKILL themselves at
step 17, with a replicated local save possibly in flight. Global checkpoints
(``ModelCheckpoint`` every 10 steps, written by ``ResilientCheckpointIO``) stop at step 10,
local ones (every 2 steps, replication factor 2) are newer. Before the restart, rank 1's
local directory is deleted (its node is lost). The resumed job must pick the newer local
checkpoint, get rank 1's shard from its peer, and end with the weights of an uninterrupted
run, bit for bit.

The uninterrupted run is computed here, in-process, with the same arithmetic as 2-rank DDP
(each rank's gradient halved, the two added, SGD with momentum), which saves a third
Lightning launch; with two ranks the all-reduce is exact, so the two must agree bitwise.
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

from resilient_ckpt.cli import main as cli_main

from .lightning_data import batch_for

pytestmark = [
    pytest.mark.dist,
    pytest.mark.fault,
    pytest.mark.skipif(
        importlib.util.find_spec("lightning") is None, reason="needs the lightning extra"
    ),
]

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lightning_job.py")
STEPS, CRASH_AT, GLOBAL_EVERY = 24, 17, 10


def _torchrun(workdir: str, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [JOB, "--workdir", workdir, "--steps", str(STEPS), "--global-every"]
    cmd += [str(GLOBAL_EVERY), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


def _uninterrupted_weights() -> dict[str, torch.Tensor]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the job's ranks (OMP_NUM_THREADS=1)
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        optim = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        for step in range(STEPS):
            grads = []
            for rank in (0, 1):
                net.zero_grad()
                x, y = batch_for(step, rank)
                torch.nn.functional.mse_loss(net(x), y).backward()
                grads.append([p.grad.clone() for p in net.parameters() if p.grad is not None])
            for param, g0, g1 in zip(net.parameters(), *grads, strict=True):
                param.grad = g0 * 0.5 + g1 * 0.5
            optim.step()
        return net.state_dict()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.timeout(420)
def test_killed_ddp_trainer_resumes_from_replicated_local_checkpoint(tmp_path) -> None:
    work = str(tmp_path / "job")
    killed = _torchrun(work, "--crash-at", str(CRASH_AT))
    assert killed.returncode != 0, killed.stdout + killed.stderr
    assert not os.path.exists(os.path.join(work, "final.pt"))
    session = os.path.join(work, "local", "lightning")
    shutil.rmtree(os.path.join(session, "1"))  # rank 1's node is gone with its files

    resumed = _torchrun(work)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    with open(os.path.join(work, "summary.json")) as f:
        summary = json.load(f)
    source = summary["resumed_from"]
    assert source["source"] == "local", summary
    assert GLOBAL_EVERY < source["step"] < CRASH_AT and source["step"] % 2 == 0
    assert summary["global_step"] == STEPS

    final = torch.load(os.path.join(work, "final.pt"))
    reference = _uninterrupted_weights()
    assert final.keys() == reference.keys()
    for key in reference:
        assert torch.equal(final[key], reference[key]), key

    # The global checkpoints were written in the background and are complete files; the
    # older one was removed by ModelCheckpoint through the plugin.
    global_dir = os.path.join(work, "global")
    last = torch.load(os.path.join(global_dir, "last.ckpt"), weights_only=False)
    assert last["global_step"] == 20 and "optimizer_states" in last
    assert sorted(os.listdir(global_dir)) == ["epoch=0-step=20.ckpt", "last.ckpt"]
    assert cli_main(["verify", session]) == 0
