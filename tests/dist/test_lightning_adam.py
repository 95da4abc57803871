"""Lightning's tiered callback with Adam on one device (DDP): the callback leaves training as
it would be without it (torch's get_state_dict gives an empty Adam state a zero-lr step,
which would start its step counter at 1), and a second fit resumes from the memory tier to
an uninterrupted fit's weights, bit for bit. On the CPU with gloo, and on CUDA with NCCL
where a GPU is."""

from __future__ import annotations

import importlib.util
import os
import warnings
from typing import Any

import pytest
import torch

from resilient_ckpt.testing import launch

pytestmark = [
    pytest.mark.dist,
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        importlib.util.find_spec("lightning") is None, reason="needs the lightning extra"
    ),
]

STEPS, FIRST = 8, 5


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)


def _fit(
    root: str, steps: int, tiered: bool, accelerator: str, backend: str
) -> tuple[dict[str, torch.Tensor], Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    from resilient_ckpt.integrations.lightning import TieredCheckpointCallback

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh())
            self.head = torch.nn.Linear(16, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = (t.to(self.device) for t in _batch(self.global_step))
            return torch.nn.functional.mse_loss(self.head(self.net(x)), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=0.01)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(range(1000), batch_size=1)

    callbacks = []
    if tiered:
        callback = TieredCheckpointCallback(
            os.path.join(root, "memory"),
            os.path.join(root, "durable"),
            every_n_train_steps=1,
            durable_every=2,
            replication_factor=1,
        )
        callbacks.append(callback)
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=1,
        strategy=DDPStrategy(process_group_backend=backend),
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=root,
    )
    model = Net()
    trainer.fit(model)
    weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return weights, (callbacks[0].resumed_from if tiered else None)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def job(rank: int, world: int, root: str, accelerator: str, backend: str) -> dict[str, Any]:
    """Fits of 5 steps without and with the callback, then one resuming to 8, and a
    reference fit of 8 steps: what the callback changed, and what the resume restored."""
    warnings.filterwarnings("ignore")
    devices = (accelerator, backend)
    reference, _ = _fit(os.path.join(root, "reference"), STEPS, False, *devices)
    plain, _ = _fit(os.path.join(root, "plain"), FIRST, False, *devices)
    first, _ = _fit(os.path.join(root, "job"), FIRST, True, *devices)
    final, resumed = _fit(os.path.join(root, "job"), STEPS, True, *devices)
    return {"resumed": resumed, "untouched": _same(plain, first), "exact": _same(reference, final)}


@pytest.mark.parametrize(
    "accelerator, backend", [("cpu", "gloo"), pytest.param("gpu", "nccl", marks=pytest.mark.gpu)]
)
def test_adam_fit_is_untouched_by_the_callback_and_resumes_exactly(
    tmp_path, accelerator, backend
) -> None:
    (facts,) = launch(job, 1, str(tmp_path), accelerator, backend, timeout=220, process_group=False)
    assert facts["untouched"], facts
    assert facts["resumed"] is not None and facts["resumed"]["step"] == FIRST, facts
    assert facts["resumed"]["tier"] == "memory", facts
    assert facts["exact"], facts
