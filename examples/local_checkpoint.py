"""Local per-rank checkpoints with clique replication, resumed after losing a rank's files.

    torchrun --standalone --nproc-per-node 4 examples/local_checkpoint.py /tmp/local_example

Run it twice: the second run resumes from the newest complete iteration, even after you
delete one rank's directory (e.g. ``rm -rf /tmp/local_example/demo/1``) in between.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from resilient_ckpt.async_ckpt.core import AsyncCallsQueue
from resilient_ckpt.local import (
    BasicTensorAwareStateDict,
    CliqueReplicationStrategy,
    LocalCheckpointManager,
)


def main(root: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    repl = CliqueReplicationStrategy.from_replication_params(
        replication_jump=1, replication_factor=2
    )
    manager = LocalCheckpointManager(root, session_id="demo", repl_strategy=repl)
    model = torch.nn.Linear(64, 64)
    start = manager.find_latest()
    if start != -1:
        state, ckpt_id = manager.load()
        model.load_state_dict(state.state_dict["model"])
        print(f"rank {rank}: resumed from {ckpt_id}", flush=True)
    queue = AsyncCallsQueue()
    for step in range(start + 1, start + 11):
        with torch.no_grad():
            model.weight.add_(0.01)
        if step % 5 == 0:
            request = manager.save(
                BasicTensorAwareStateDict({"model": model.state_dict()}), step, is_async=True
            )
            queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=False, no_dist=False)
    queue.close()
    print(f"rank {rank}: latest complete iteration {manager.find_latest()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/resilient_ckpt_local_example")
