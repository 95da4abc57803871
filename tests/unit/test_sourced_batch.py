"""The async DCP writer's buckets are staged without detaching their tensors (issue 13): a
``SourcedBatch`` is described as the detached tensors would be, found with its checks for a
full staging and by a quick lookup only when the staging cache may hit, whose layout-key
comparison then stands for the checks."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from resilient_ckpt._torch_compat import no_dist_kwargs
from resilient_ckpt.async_ckpt import _dcp_buckets, _persistent
from resilient_ckpt.async_ckpt._staging import ArenaPool, SourcedBatch, stage, unstage
from resilient_ckpt.async_ckpt._structure import StageCache
from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from resilient_ckpt.async_ckpt.state_dict_saver import (
    CheckpointMetadataCache,
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::UserWarning")]


def _never() -> bool:
    return False


class _Sources:
    """A batch owner that counts how it was asked for its tensors."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.calls: list[str] = []

    def checked(self) -> list[torch.Tensor]:
        self.calls.append("checked")
        return list(self.tensors)

    def quick(self) -> list[torch.Tensor]:
        self.calls.append("quick")
        return list(self.tensors)


def test_a_sourced_batch_is_staged_as_detached_tensors_and_checked_only_when_staged_fully():
    pool = ArenaPool(1)
    cache = StageCache()
    base = torch.arange(12, dtype=torch.float32)
    sources = _Sources([torch.nn.Parameter(torch.ones(3)), base, base[2:6], torch.full((2,), 5.0)])
    # Save 1 is a full staging; 2 meets the same layout; 3 has a tensor of another shape.
    for n in range(3):
        if n == 2:
            sources.tensors[3] = torch.full((4,), 6.0)
        expected = [t.detach().clone() for t in sources.tensors]
        sources.calls.clear()
        staged = stage(
            ("fn", SourcedBatch(sources.checked, sources.quick)), pool, _never, cache=cache
        )
        assert sources.calls == [["checked"], ["quick"], ["quick", "checked"]][n], f"save {n}"
        for t in sources.tensors:
            t.data.add_(100)  # training goes on after the call
        _, got = unstage(staged.payload, staged.arena, staged.slots)
        assert type(got) is list and len(got) == len(expected)
        for want, have in zip(expected, got, strict=True):
            assert type(have) is torch.Tensor and not have.requires_grad
            assert torch.equal(want, have)
        assert got[1].untyped_storage().data_ptr() == got[2].untyped_storage().data_ptr()
        assert got[1].untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
        del got
        pool.release(staged.arena.arena_id)
        for t in sources.tensors:
            t.data.sub_(100)
    pool.close()


def _save(queue: AsyncCallsQueue, state: dict, path, cache: CheckpointMetadataCache) -> None:
    writer = FileSystemWriterAsync(str(path), thread_count=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ret = save_state_dict_async_plan(state, writer, enable_cache=True, metadata_cache=cache)
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    finalize = [lambda: save_state_dict_async_finalize(*ret)]
    queue.schedule_async_request(AsyncRequest(save_fn, args, finalize, preload_fn=preload_fn))


def _saves(tmp_path, state: dict, monkeypatch, count: int = 3) -> tuple[list[str], int]:
    """Save ``state`` ``count`` times, changing its values after each call; check each
    checkpoint; how the buckets were resolved, and the most bytes one save staged."""
    staged_bytes: list[int] = []

    def sized(*args, **kwargs):
        staged = stage(*args, **kwargs)
        staged_bytes.append(staged.nbytes)
        return staged

    monkeypatch.setattr(_persistent, "stage", sized)
    calls: list[str] = []
    for name in ("resolve_sources", "quick_sources"):
        original = getattr(_dcp_buckets, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(_dcp_buckets, name, counted)
    queue = AsyncCallsQueue()
    cache = CheckpointMetadataCache()
    try:
        for n in range(count):
            expected = {k: v.detach().clone() for k, v in state.items() if torch.is_tensor(v)}
            _save(queue, state, tmp_path / f"s{n}", cache)
            for value in expected:
                state[value].data.add_(10)
            queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
            loaded = {k: torch.zeros_like(v) for k, v in expected.items()}
            dcp.load(loaded, checkpoint_id=str(tmp_path / f"s{n}"), **no_dist_kwargs(dcp.load))
            for key, value in expected.items():
                assert torch.equal(loaded[key], value), (n, key)
        assert len(staged_bytes) == count, staged_bytes
        return calls, max(staged_bytes)
    finally:
        queue.close()


def test_dcp_steady_saves_stage_the_state_by_the_quick_lookup(tmp_path, monkeypatch) -> None:
    state = {f"w{i}": torch.randn(16 + i) for i in range(5)}
    state["param"] = torch.nn.Parameter(torch.ones(3))
    state["step"] = 1
    calls, _ = _saves(tmp_path, state, monkeypatch)
    # One bucket per thread; a full staging checks, a steady one only looks up.
    assert calls == ["resolve_sources"] * 2 + ["quick_sources"] * 4


def test_dcp_view_into_a_larger_storage_is_never_staged_by_the_quick_lookup(
    tmp_path, monkeypatch
) -> None:
    big = torch.arange(1000, dtype=torch.float32)
    state = {"view": big[10:20], "w": torch.randn(8)}
    calls, staged = _saves(tmp_path, state, monkeypatch)
    # The view is cloned (its 40 bytes staged, not the 4000 of its base), a fresh storage
    # every save, so the quick lookup (the raw view) never matches the layout.
    assert staged < 1000, staged
    assert "quick_sources" in calls and calls.count("resolve_sources") >= 3
