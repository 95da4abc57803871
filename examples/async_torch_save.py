"""Async torch.save from every rank, finalized across ranks.

torchrun --standalone --nproc-per-node 2 examples/async_torch_save.py /tmp/ckpt_example
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from resilient_ckpt.async_ckpt import TorchAsyncCheckpoint


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    os.makedirs(out_dir, exist_ok=True)
    model = torch.nn.Linear(256, 256)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = TorchAsyncCheckpoint()
    for step in range(1, 21):
        ckpt.finalize_async_save(blocking=False, no_dist=False)
        optim.zero_grad()
        model(torch.randn(8, 256)).square().mean().backward()
        optim.step()
        if step % 5 == 0:
            ckpt.async_save(
                {"model": model.state_dict(), "step": step},
                os.path.join(out_dir, f"step{step}_rank{rank}.pt"),
            )
    ckpt.finalize_async_save(blocking=True, no_dist=False, terminate=True)
    if rank == 0:
        print("saved:", sorted(os.listdir(out_dir)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/resilient_ckpt_example")
