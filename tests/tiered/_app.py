"""A small deterministic training job for the tiered tests (imported by spawned ranks).

The state is what a torchtitan-style job checkpoints: a ``Stateful`` app holding a model
and its optimizer (through ``get_state_dict``/``set_state_dict``), a DTensor sharded over
all ranks, a replicated tensor and plain picklable values. ``train(app, step)`` is
deterministic, so the state after step ``s`` can be recomputed from scratch anywhere and
compared bit for bit, at any world size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh

from resilient_ckpt._torch_compat import DTensor, Shard, distribute_tensor

ROWS, COLS = 8, 6


class App(Stateful):
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 3)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        full = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
        self.w: DTensor = distribute_tensor(full, mesh, [Shard(0)])
        self.bias = torch.zeros(COLS)
        self.extra: dict[str, Any] = {"step": 0, "tag": "tiered"}

    def state_dict(self) -> dict[str, Any]:
        model, optim = get_state_dict(self.model, self.opt)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.opt,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )

    def checkpoint(self) -> dict[str, Any]:
        """What the job hands to save/load (the app itself as a Stateful)."""
        return {"app": self, "w": self.w, "bias": self.bias, "extra": self.extra}

    def snapshot(self) -> dict[str, torch.Tensor | Any]:
        """Everything comparable, as full (unsharded) CPU values."""
        out: dict[str, Any] = {
            f"model.{k}": v.detach().clone() for k, v in self.model.state_dict().items()
        }
        for i, group in enumerate(self.opt.state.values()):
            out[f"momentum.{i}"] = group["momentum_buffer"].clone()
        out["w"] = self.w.full_tensor().clone()
        out["bias"] = self.bias.clone()
        out["extra"] = dict(self.extra)
        return out


def train(app: App, step: int) -> None:
    x = torch.arange(8.0).reshape(2, 4) / (step + 1)
    app.opt.zero_grad()
    app.model(x).pow(2).sum().backward()
    app.opt.step()
    local = app.w.to_local()
    local.mul_(0.5).add_(step)
    app.bias.add_(step * 0.25)
    app.extra["step"] = step


def reference(step: int) -> dict[str, Any]:
    app = App()
    for s in range(1, step + 1):
        train(app, s)
    return app.snapshot()


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        if isinstance(a[k], torch.Tensor):
            if not torch.equal(a[k], b[k]):
                return False
        elif a[k] != b[k]:
            return False
    return True
