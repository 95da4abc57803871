"""Staging takes explicit data (issue 46): a request argument that is a ``StagingSource``
hands staging a skeleton and a flat list of tensors, which the worker gets back rebuilt over
the arena, detached, with the sharing of storages kept; the async DCP writer's buckets are
staged that way, each save holding its call's values, a view into a larger storage staged
as its own bytes."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from resilient_ckpt._torch_compat import no_dist_kwargs
from resilient_ckpt.async_ckpt import _persistent
from resilient_ckpt.async_ckpt._staging import (
    ArenaPool,
    StagingPart,
    StagingSource,
    request_sources,
    stage,
    unstage,
)
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


class _Source(StagingSource):
    """An explicit source: its tensors, rebuilt in the worker as a list."""

    def __init__(self, tensors: list[torch.Tensor], key: object) -> None:
        self.tensors = tensors
        self.key = key

    def staging_part(self) -> StagingPart:
        return StagingPart(_as_list, ("tag",), list(self.tensors), self.key, checked=False)


def _as_list(tag: str, tensors: list[torch.Tensor]) -> tuple[str, list[torch.Tensor]]:
    return tag, tensors


def test_an_explicit_source_is_staged_as_detached_tensors_with_its_sharing_kept():
    pool = ArenaPool(1)
    cache = StageCache()
    base = torch.arange(12, dtype=torch.float32)
    source = _Source([torch.nn.Parameter(torch.ones(3)), base, base[2:6], torch.full((2,), 5.0)], 1)
    # Save 1 is a full staging; 2 meets the same layout; 3 has a tensor of another shape.
    for n in range(3):
        if n == 2:
            source.tensors[3] = torch.full((4,), 6.0)
        expected = [t.detach().clone() for t in source.tensors]
        request = ("fn", (0, source, "other"), None, None)
        staged = stage(request, pool, _never, cache=cache, sources=request_sources(request))
        for t in source.tensors:
            t.data.add_(100)  # training goes on after the call
        fn, (_, (tag, got), other), _, _ = unstage(staged.payload, staged.arena, staged.slots)
        assert (fn, tag, other) == ("fn", "tag", "other")
        assert type(got) is list and len(got) == len(expected)
        for want, have in zip(expected, got, strict=True):
            assert type(have) is torch.Tensor and not have.requires_grad
            assert torch.equal(want, have)
        assert got[1].untyped_storage().data_ptr() == got[2].untyped_storage().data_ptr()
        assert got[1].untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
        del got
        pool.release(staged.arena.arena_id)
        for t in source.tensors:
            t.data.sub_(100)
    pool.close()


def test_an_explicit_source_with_a_conjugate_tensor_is_staged_by_value():
    pool = ArenaPool(1)
    source = _Source([torch.ones(2), torch.tensor([1 + 2j, 3 - 1j]).conj()], 1)
    request = ("fn", (0, source), None, None)
    staged = stage(request, pool, _never, cache=StageCache(), sources=request_sources(request))
    _, (_, got), _, _ = unstage(staged.payload, staged.arena, staged.slots)
    assert isinstance(got, _Source) and torch.equal(got.tensors[1], source.tensors[1])
    pool.close()


def _save(queue: AsyncCallsQueue, state: dict, path, cache: CheckpointMetadataCache) -> None:
    writer = FileSystemWriterAsync(str(path), thread_count=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ret = save_state_dict_async_plan(state, writer, enable_cache=True, metadata_cache=cache)
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    finalize = [lambda: save_state_dict_async_finalize(*ret)]
    queue.schedule_async_request(AsyncRequest(save_fn, args, finalize, preload_fn=preload_fn))


def _saves(tmp_path, state: dict, monkeypatch, count: int = 3) -> int:
    """Save ``state`` ``count`` times, changing its values after each call; check each
    checkpoint; the most bytes one save staged."""
    staged_bytes: list[int] = []

    def sized(*args, **kwargs):
        staged = stage(*args, **kwargs)
        staged_bytes.append(staged.nbytes)
        return staged

    monkeypatch.setattr(_persistent, "stage", sized)
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
        return max(staged_bytes)
    finally:
        queue.close()


def test_dcp_steady_saves_hold_each_calls_values(tmp_path, monkeypatch) -> None:
    state = {f"w{i}": torch.randn(16 + i) for i in range(5)}
    state["param"] = torch.nn.Parameter(torch.ones(3))
    state["step"] = 1
    _saves(tmp_path, state, monkeypatch)


def test_dcp_view_into_a_larger_storage_is_staged_as_its_own_bytes(tmp_path, monkeypatch) -> None:
    big = torch.arange(1000, dtype=torch.float32)
    state = {"view": big[10:20], "w": torch.randn(8)}
    # The view is cloned every save: its 40 bytes staged, not the 4000 of its base.
    assert _saves(tmp_path, state, monkeypatch) < 1000
