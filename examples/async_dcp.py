"""Async ``torch.distributed.checkpoint`` saves with a cached plan, then a load and a verify.

    torchrun --standalone --nproc-per-node 2 examples/async_dcp.py /tmp/dcp_example

Every rank saves its shard of the state every few steps in the background; ``.metadata``
(the commit record) appears only once every rank's write succeeded. Afterwards
``resilient-ckpt verify /tmp/dcp_example`` checks every byte of every checkpoint.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from resilient_ckpt.async_ckpt.state_dict_saver import (
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)


def save_async(queue: AsyncCallsQueue, state: dict, path: str) -> None:
    writer = FileSystemWriterAsync(path, thread_count=2)
    # Collective; with enable_cache the plan of the previous save is reused while the
    # state's structure does not change.
    plan = save_state_dict_async_plan(state, writer, enable_cache=True)
    save_fn, preload_fn, save_args = writer.get_save_function_and_args()
    finalize = [lambda: save_state_dict_async_finalize(*plan)]  # commits .metadata
    queue.schedule_async_request(AsyncRequest(save_fn, save_args, finalize, preload_fn=preload_fn))


def main(root: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = torch.nn.Linear(256, 256)
    queue = AsyncCallsQueue()
    for step in range(1, 11):
        queue.maybe_finalize_async_calls(blocking=False, no_dist=False)
        with torch.no_grad():
            model.weight.add_(0.01)  # stands in for a training step
        if step % 5 == 0:
            # Keys differ per rank here (each rank saves its own shard of a toy state).
            state = {f"rank{rank}.{k}": v for k, v in model.state_dict().items()}
            save_async(queue, state, os.path.join(root, f"iter_{step:07d}"))
    queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    queue.close()

    loaded = {f"rank{rank}.{k}": torch.empty_like(v) for k, v in model.state_dict().items()}
    dcp.load(loaded, checkpoint_id=os.path.join(root, "iter_0000010"))
    assert torch.equal(loaded[f"rank{rank}.weight"], model.weight.detach())
    if rank == 0:
        print(f"saved and reloaded iter_0000005 and iter_0000010 under {root}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/dcp_example")
