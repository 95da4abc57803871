"""torchtitan's own ``CheckpointManager`` (PyPI ``torchtitan``, CPU, gloo, an FSDP2 model) saving
through ``resilient_ckpt.dcp``: the one-line switch its guide documents, ``import
resilient_ckpt.dcp as dcp`` in ``torchtitan/components/checkpointer/dcp.py`` (issue 48).

Skipped where torchtitan is not installed (``make venv`` installs it).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from resilient_ckpt.testing.launcher import launch

pytest.importorskip("torchtitan.components.checkpointer.dcp")

from tests import _helpers

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


class _Optimizer:
    """torchtitan's optimizers container as the manager uses it: a ``Stateful``."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


class _Counter:
    def __init__(self) -> None:
        self.steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps = state_dict["steps"]


def _trainer(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _helpers.fsdp2_model(world, outputs=4)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _manager(folder: str, model: Any, optimizer: Any, counter: _Counter, mode: str) -> Any:
    from torchtitan.components.checkpointer.dcp import CheckpointManager

    config = CheckpointManager.Config(
        enable=True, folder=folder, interval=2, async_mode=mode, last_save_model_only=False
    )
    return CheckpointManager(
        config,
        dataloader=None,
        model_parts=[model],
        optimizers=_Optimizer(model, optimizer),
        lr_schedulers=counter,
        states={},
        sd_adapter=None,
    )


def _local(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in model.parameters()]  # type: ignore[attr-defined]


def _train_save_resume(rank: int, world: int, root: str, mode: str) -> list[str]:
    import torchtitan.components.checkpointer.dcp as titan

    import resilient_ckpt.dcp

    titan.dcp = resilient_ckpt.dcp  # the guide's one-line change, made at run time
    folder = os.path.join(root, mode)
    model, optimizer = _trainer(world)
    counter = _Counter()
    manager = _manager(folder, model, optimizer, counter, mode)
    saved: list[torch.Tensor] = []
    for step in range(1, 7):
        manager.maybe_wait_for_staging()
        loss = model(torch.randn(8, 16)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        counter.steps = step
        manager.save(step, last_step=step == 6)
        if step == 6:
            saved = _local(model)
    manager.maybe_wait_for_saving()
    manager.close()
    resilient_ckpt.dcp.close()

    # A fresh trainer resumes from the newest checkpoint, read by torch's dcp.load.
    model2, optimizer2 = _trainer(world)
    counter2 = _Counter()
    resumed = _manager(folder, model2, optimizer2, counter2, mode)
    assert resumed.load()
    assert counter2.steps == 6
    assert all(torch.equal(a, b) for a, b in zip(_local(model2), saved, strict=True))
    resumed.close()
    return sorted(os.listdir(folder))


@pytest.mark.parametrize("mode", ["async", "disabled"])
def test_torchtitan_checkpoint_manager_saves_through_resilient_ckpt_dcp(tmp_path, mode) -> None:
    from resilient_ckpt.async_ckpt.verify import verify_checkpoint

    steps = launch(_train_save_resume, 2, str(tmp_path), mode, timeout=280)[0]
    assert steps == ["step-2", "step-4", "step-6"]
    for step in steps:  # written by our engine: every rank's CRC-32s recorded
        verified = verify_checkpoint(str(tmp_path / mode / step))
        assert verified.checksummed and len(verified.files) == 2
