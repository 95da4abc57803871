"""CUDA tensors are staged to host memory before schedule returns (runs only with a GPU)."""

from __future__ import annotations

import pytest
import torch

from resilient_ckpt import TorchAsyncCheckpoint
from resilient_ckpt.async_ckpt._staging import ArenaPool, stage, unstage

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


@pytest.mark.parametrize("overlap", [False, True])
def test_steady_saves_of_cuda_state_each_hold_the_values_of_their_call(tmp_path, overlap) -> None:
    """Device copies (typed views of the arena, each tensor copied as itself or as its
    storage's raw bytes), saved with an unchanged layout and after a new one: every
    checkpoint holds exactly its call's values."""
    base = torch.arange(64.0, device="cuda")
    state = {
        "w": torch.randn(256, 33, device="cuda"),
        "t": torch.randn(33, 256, device="cuda").t(),  # its storage's raw bytes
        "base": base,
        "view": base[8:24],  # shares the base's slot
        "h": torch.randn(1000, device="cuda", dtype=torch.bfloat16)[3:],  # a view alone
        "cpu": torch.randn(7),
        "step": 0,
    }
    ckpt = TorchAsyncCheckpoint()
    try:
        for n in range(5):
            if n == 3:
                state["w"] = torch.randn(128, 33, device="cuda")  # a new layout
            expected = {
                k: v.to("cpu", copy=True) if torch.is_tensor(v) else v for k, v in state.items()
            }
            ckpt.async_save(state, tmp_path / f"{n}.pt", overlap_staging=overlap)
            ckpt.wait_for_snapshot()
            for key in ("w", "t", "base", "h", "cpu"):
                state[key].add_(1)
            state["step"] = n + 1
            ckpt.finalize_async_save(blocking=True)
            loaded = torch.load(tmp_path / f"{n}.pt", map_location="cpu")
            assert loaded.keys() == expected.keys()
            for key, value in expected.items():
                if torch.is_tensor(value):
                    assert loaded[key].dtype == value.dtype, key
                    assert torch.equal(loaded[key], value), (n, key)
                else:
                    assert loaded[key] == value
            assert torch.equal(loaded["view"], loaded["base"][8:24])
    finally:
        ckpt.close()


def test_overlapped_staging_orders_its_copies_after_the_call_only(tmp_path) -> None:
    """Overlapped staging copies CUDA tensors on a side stream, from the staging thread:
    the copies wait for the kernels queued before the call (the value written after a long
    kernel is the one saved) and the wait does not wait for kernels queued after it (the
    trainer's stream is still busy when the snapshot is complete)."""
    ckpt = TorchAsyncCheckpoint()
    w = torch.zeros(1 << 22, device="cuda")
    state = {"w": w, "b": torch.randn(300, 7, device="cuda").t()}
    stream = torch.cuda.current_stream()
    try:
        # A first save starts the worker (which the first wait for a snapshot waits for) and
        # makes the pinned arena: the checks below are of steady saves.
        ckpt.async_save(state, tmp_path / "warm.pt")
        ckpt.finalize_async_save(blocking=True)
        for n in range(3):
            expected_b = state["b"].cpu()  # (synchronizes: before the long kernel)
            torch.cuda._sleep(50_000_000)  # keeps the trainer's stream busy before the call
            w.fill_(n + 1)
            ckpt.async_save(state, tmp_path / f"{n}.pt", overlap_staging=True)
            torch.cuda._sleep(2_000_000_000)  # about a second of work queued after the call
            ckpt.wait_for_snapshot()
            assert not stream.query(), "the snapshot waited for work queued after the call"
            w.fill_(-1)
            state["b"].add_(1)
            ckpt.finalize_async_save(blocking=True)
            loaded = torch.load(tmp_path / f"{n}.pt", map_location="cpu")
            assert torch.equal(loaded["w"], torch.full((1 << 22,), float(n + 1))), n
            assert torch.equal(loaded["b"], expected_b), n
        torch.cuda.synchronize()
    finally:
        ckpt.close()
