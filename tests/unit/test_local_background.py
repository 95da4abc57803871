"""The replicated-save buffer pool reuses buffers of different sizes."""

from __future__ import annotations

from resilient_ckpt.local._background import BackgroundSaves


def test_acquire_picks_the_smallest_fitting_buffer_among_sizes() -> None:
    pool = BackgroundSaves(max_buffers=2)
    small, large = pool.acquire(100, timeout=5), pool.acquire(200, timeout=5)
    pool.release(small)
    pool.release(large)
    # A state whose size changed between saves (as a Lightning checkpoint's does).
    again = pool.acquire(150, timeout=5)
    assert again.numel() == 150 and again._base is large
    assert pool.acquire(50, timeout=5)._base is small
