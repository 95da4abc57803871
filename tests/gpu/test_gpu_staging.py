"""CUDA tensors are staged to host memory before schedule returns (runs only with a GPU)."""

from __future__ import annotations

import pytest
import torch

from resilient_ckpt import TorchAsyncCheckpoint
from resilient_ckpt.async_ckpt._staging import ArenaPool, stage
from resilient_ckpt.async_ckpt._unstaging import unstage

pytestmark = pytest.mark.gpu


def _never() -> bool:
    return False


def test_cuda_tensors_are_staged_to_host() -> None:
    pool = ArenaPool(1)
    src = {"w": torch.arange(1 << 20, device="cuda", dtype=torch.float32)}
    staged = stage(src, pool, _never)
    src["w"].mul_(-1)
    out = unstage(staged.payload, staged.arena, staged.slots)
    assert out["w"].device.type == "cpu"
    assert torch.equal(out["w"], torch.arange(1 << 20, dtype=torch.float32))
    pool.close()


@pytest.mark.parametrize("persistent", [True, False])
def test_async_save_of_cuda_state_is_a_snapshot(tmp_path, persistent) -> None:
    ckpt = TorchAsyncCheckpoint(persistent_queue=persistent)
    state = {"w": torch.ones(4096, device="cuda"), "n": 3}
    path = tmp_path / "g.pt"
    ckpt.async_save(state, path)
    state["w"].add_(1)
    ckpt.finalize_async_save(blocking=True)
    loaded = torch.load(path)
    assert torch.equal(loaded["w"].cpu(), torch.ones(4096)) and loaded["n"] == 3
    ckpt.close()
