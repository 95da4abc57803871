"""Staging at copy speed: re-staging on structure changes, overlapped snapshots, warm-up,
bounded memory (issue 13). Timings are benchmarked (benchmarks/stall.py), never asserted."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from resilient_ckpt.async_ckpt import _copy
from resilient_ckpt.async_ckpt._arena import open_arena_fds
from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from resilient_ckpt.async_ckpt.state_dict_saver import (
    CheckpointMetadataCache,
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from resilient_ckpt.async_ckpt.torch_ckpt import TorchAsyncCheckpoint
from resilient_ckpt.async_ckpt.warmup import warmup_async_save
from resilient_ckpt.errors import ConfigurationError
from resilient_ckpt.testing.faults import worker_pids
from tests._helpers import memfd_mappings

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _state(n_small: int = 40, big: int = 0) -> dict:
    torch.manual_seed(0)
    state: dict = {f"small{i}": torch.randn(17 + i) for i in range(n_small)}
    if big:
        state["big"] = torch.randn(big)
    base = torch.arange(64, dtype=torch.float32)
    state["base"] = base
    state["view"] = base[8:24]  # shares base's storage
    state["step"] = 3
    return state


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        if torch.is_tensor(value):
            assert value.dtype == b[key].dtype and torch.equal(value, b[key]), key
        else:
            assert value == b[key], key


def test_copy_plan_coalesces_contiguous_ranges_and_splits_evenly(monkeypatch) -> None:
    segments = [(1000, 5000, 10), (1010, 5010, 6), (1100, 6000, 4), (1104, 7000, 0)]
    assert _copy.coalesce(segments) == [(1000, 5000, 16), (1100, 6000, 4)]
    monkeypatch.setattr(_copy, "PARALLEL_MIN_BYTES", 1)
    big = [(0, 100, 10), (10, 300, 25), (35, 900, 5)]
    shares = _copy.split_shares(big, 3)
    assert len(shares) == 3
    assert [sum(n for _, _, n in share) for share in shares] == [14, 14, 12]
    covered = sorted((d, s, n) for share in shares for d, s, n in share)
    flat = [(d + k, s + k) for d, s, n in covered for k in range(n)]
    assert flat == [(d + k, s + k) for d, s, n in big for k in range(n)]


def test_copy_threads_setting_is_validated(monkeypatch) -> None:
    monkeypatch.setenv(_copy.COPY_THREADS_ENV, "3")
    assert _copy.default_copy_threads() == 3
    monkeypatch.setenv(_copy.COPY_THREADS_ENV, "zero")
    with pytest.raises(ConfigurationError, match="RESILIENT_CKPT_COPY_THREADS"):
        _copy.default_copy_threads()
    monkeypatch.delenv(_copy.COPY_THREADS_ENV)
    assert 1 <= _copy.default_copy_threads() <= 4
    with pytest.raises(ConfigurationError, match="copy_threads"):
        AsyncCallsQueue(copy_threads=0)


@pytest.mark.timeout(120)
def test_changed_structure_is_restaged(tmp_path) -> None:
    """Added tensor, changed shape, changed dtype, removed key: each save holds exactly
    the state of its call; views keep sharing their base's storage."""
    ckpt = TorchAsyncCheckpoint(copy_threads=2)
    try:
        state = _state()
        changes = [
            ("same", lambda s: s["small0"].add_(1)),
            ("added", lambda s: s.__setitem__("extra", torch.ones(5, 3))),
            ("shape", lambda s: s.__setitem__("small3", torch.randn(99))),
            ("dtype", lambda s: s.__setitem__("small4", s["small4"].double())),
            ("removed", lambda s: s.pop("small5")),
        ]
        for n, (what, change) in enumerate(changes):
            change(state)
            expected = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
            ckpt.async_save(state, str(tmp_path / f"{n}.pt"))
            for value in state.values():
                if torch.is_tensor(value):
                    value.add_(100)  # after the call: must not reach the checkpoint
            ckpt.finalize_async_save(blocking=True)
            for value in state.values():
                if torch.is_tensor(value):
                    value.sub_(100)
            loaded = torch.load(tmp_path / f"{n}.pt")
            _same(expected, loaded)
            base, view = loaded["base"], loaded["view"]
            assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr(), what
    finally:
        ckpt.close()


@pytest.mark.timeout(120)
def test_overlapped_snapshot_holds_values_of_the_call(tmp_path) -> None:
    """overlap_staging returns before the copy; after wait_for_snapshot the tensors may
    change and the checkpoint still holds the values they had at the call."""
    ckpt = TorchAsyncCheckpoint(copy_threads=2)
    try:
        state = _state(n_small=300, big=3 << 20)  # 12 MiB: split over the copy threads
        for step in range(3):
            expected = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
            path = tmp_path / f"overlap{step}.pt"
            ckpt.async_save(state, str(path), overlap_staging=True)
            ckpt.wait_for_snapshot()
            for value in state.values():
                if torch.is_tensor(value):
                    value.mul_(-1).add_(7)  # the "optimizer step"
            ckpt.finalize_async_save(blocking=True)
            _same(expected, torch.load(path))
        # Never calling wait_for_snapshot is safe too: the next call on the queue waits.
        expected = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
        ckpt.async_save(state, str(tmp_path / "implicit.pt"), overlap_staging=True)
        ckpt.finalize_async_save(blocking=True)
        _same(expected, torch.load(tmp_path / "implicit.pt"))
    finally:
        ckpt.close()


@pytest.mark.timeout(120)
def test_warmup_presizes_the_arena_and_memory_stays_bounded(tmp_path) -> None:
    """After warmup(state) the saves open no new shared-memory segment: 50 saves of one
    structure keep one memfd, in the trainer and in the worker; a state that outgrows the
    arena replaces it, and the worker unmaps the old one."""
    gc.collect()  # queues of earlier tests still awaiting collection must not move the counts
    before, maps_before = open_arena_fds(), memfd_mappings()
    ckpt = TorchAsyncCheckpoint()
    try:
        state = _state(n_small=20, big=1 << 16)
        ckpt.warmup(state)
        (worker,) = worker_pids(ckpt.queue)
        assert open_arena_fds() == before + 1
        for i in range(50):
            state["small0"].fill_(i)
            ckpt.async_save(state, str(tmp_path / "steady.pt"))
            ckpt.finalize_async_save(blocking=True)
            assert open_arena_fds() == before + 1, f"save {i}: a new memfd"
            assert memfd_mappings(worker) == 1, f"save {i}: the worker maps another arena"
        assert memfd_mappings() == maps_before + 1
        assert memfd_mappings(worker) == 1
        assert torch.load(tmp_path / "steady.pt")["small0"][0].item() == 49
        state["big"] = torch.randn(1 << 20)  # outgrows the arena
        for _ in range(3):
            ckpt.async_save(state, str(tmp_path / "grown.pt"))
            ckpt.finalize_async_save(blocking=True)
        assert open_arena_fds() == before + 1  # the outgrown one was closed
        assert memfd_mappings() == maps_before + 1
        assert memfd_mappings(worker) == 1  # ... and unmapped by the worker
        _same(state, torch.load(tmp_path / "grown.pt"))
    finally:
        ckpt.close()
    assert open_arena_fds() == before


def _dcp_save(queue: AsyncCallsQueue, state: dict, path, cache, overlap: bool) -> None:
    writer = FileSystemWriterAsync(str(path), thread_count=2)
    plan_ret = save_state_dict_async_plan(state, writer, enable_cache=True, metadata_cache=cache)
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    finalize = [lambda: save_state_dict_async_finalize(*plan_ret)]
    request = AsyncRequest(save_fn, args, finalize, preload_fn=preload_fn)
    queue.schedule_async_request(request, overlap_staging=overlap)
    queue.wait_for_snapshot()


@pytest.mark.timeout(180)
def test_async_dcp_flow_restages_on_structure_change(tmp_path) -> None:
    """Each change of structure (a key added, a shape, a dtype) and the saves after it hold
    exactly the values of their call, staged in the call or overlapped."""
    warnings.filterwarnings("ignore")
    cache = CheckpointMetadataCache()
    queue = AsyncCallsQueue()
    state = {k: v for k, v in _state(n_small=30).items() if k != "view"}
    changes = [
        ("same", lambda s: s["small1"].add_(1)),
        ("same again", lambda s: s["small2"].add_(1)),
        ("added", lambda s: s.__setitem__("extra", torch.ones(4, 4))),
        ("same after added", lambda s: s["extra"].add_(1)),
        ("shape", lambda s: s.__setitem__("small3", torch.randn(77))),
        ("dtype", lambda s: s.__setitem__("small4", s["small4"].half())),
        ("same after dtype", lambda s: s["small4"].add_(1)),
    ]
    try:
        for n, (_what, change) in enumerate(changes):
            change(state)
            expected = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
            _dcp_save(queue, state, tmp_path / f"d{n}", cache, overlap=n % 2 == 1)
            for value in state.values():
                if torch.is_tensor(value):
                    value.add_(50)
            queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
            for value in state.values():
                if torch.is_tensor(value):
                    value.sub_(50)
            target = {
                k: torch.zeros_like(v) if torch.is_tensor(v) else None for k, v in state.items()
            }
            dcp.load(target, checkpoint_id=str(tmp_path / f"d{n}"))
            _same(expected, target)
    finally:
        queue.close()


@pytest.mark.timeout(120)
def test_warmup_async_save_sizes_the_arena_and_the_first_save_holds_its_values(tmp_path) -> None:
    warnings.filterwarnings("ignore")
    cache = CheckpointMetadataCache()
    queue = AsyncCallsQueue()
    state = {k: v for k, v in _state(n_small=10).items() if k != "view"}
    try:
        before = open_arena_fds()
        warmup_async_save(state, queue, metadata_cache=cache, thread_count=2)
        assert open_arena_fds() == before + 1  # the warm-up sized the arena
        _dcp_save(queue, state, tmp_path / "first", cache, overlap=False)
        queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
        assert open_arena_fds() == before + 1  # the first save fits in it
        target = {k: torch.zeros_like(v) if torch.is_tensor(v) else None for k, v in state.items()}
        dcp.load(target, checkpoint_id=str(tmp_path / "first"))
        _same(state, target)
    finally:
        queue.close()
