"""The performance contract of the steady-state fast paths: the one test file that names the
caches' hit, miss and refresh counters (and the copy plan's ranges).

Every other test checks behaviour: each checkpoint holds exactly the values of its call, a
changed structure is saved and loads right, shared-memory segments and memory stay bounded.
Whether a save took a fast path is invisible there on purpose: a fast path taken wrongly
shows as a wrong checkpoint, one not taken only as a slower save. So the counters are the
contract of the fast paths (docs/design.md, "The steady state" under Staging and "Planning
and its cache" under Async DCP): a save laid out as the last one reuses the plan and the
staging, a warm-up makes the first save such a save, and every change that matters is
planned or staged afresh. They are named here and nowhere else, so a redesign that replaces
a cache rewrites one file, keeping each check under the new mechanism's counters. How fast
the paths are is measured in ``benchmarks/``, never asserted.

The changes each check walks through are the behaviour tests' own tables, imported from
their modules, so the contract and the behaviour cover the same cases. Three checks need
ranks (marked ``dist``, started by ``resilient_ckpt.testing.launch``): a steady save runs no
planning collective on any rank while a change on one rank re-plans every rank, ShardedTensor
states with their own planner keep the cache, and the tiered warm-up plans the first save
ahead."""

from __future__ import annotations

import collections
import warnings
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from resilient_ckpt.async_ckpt import _copy
from resilient_ckpt.async_ckpt._arena import Arena
from resilient_ckpt.async_ckpt._staging import ArenaPool, stage
from resilient_ckpt.async_ckpt._structure import StageCache
from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from resilient_ckpt.async_ckpt.state_dict_saver import (
    CheckpointMetadataCache,
    save_state_dict_async_finalize,
)
from resilient_ckpt.async_ckpt.torch_ckpt import TorchAsyncCheckpoint
from resilient_ckpt.async_ckpt.warmup import warmup_async_save
from resilient_ckpt.local import BasicTensorAwareStateDict
from resilient_ckpt.local._shard_cache import ShardPlanCache, plan_shard
from resilient_ckpt.testing import launch
from tests import _helpers
from tests.unit import test_deferred_plan as deferred
from tests.unit import test_shard_header_refresh as shards
from tests.unit import test_shard_records as records
from tests.unit import test_stage_cache as layouts
from tests.unit import test_steady_state as steady

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _never() -> bool:
    return False


def _counts(cache) -> tuple[int, int]:
    return cache.hits, cache.misses


def _dcp_save_finalized(queue, state, path, cache) -> None:
    steady._dcp_save(queue, state, path, cache)
    queue.maybe_finalize_async_calls(blocking=True, no_dist=True)


# -- the DCP plan cache ---------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_a_steady_dcp_save_reuses_the_plan_and_every_structure_change_replans(tmp_path) -> None:
    warnings.filterwarnings("ignore")
    cache = CheckpointMetadataCache()
    queue = AsyncCallsQueue()
    state = steady._dcp_state()
    try:
        _dcp_save_finalized(queue, state, tmp_path / "first", cache)
        assert _counts(cache) == (0, 1)
        for n, (what, change, reusable) in enumerate(steady.DCP_CHANGES):
            change(state)
            hits, misses = _counts(cache)
            _dcp_save_finalized(queue, state, tmp_path / f"d{n}", cache)
            assert _counts(cache) == (hits + reusable, misses + (not reusable)), what
    finally:
        queue.close()


# Changes that keep the plan but may move a tensor's bytes (the allocator may reuse them).
_MOVED = {"tensor replaced by a new object of the same shape", "storage swapped in place"}


@pytest.mark.timeout(180)
def test_a_dcp_save_restages_in_full_exactly_when_its_plan_changed(tmp_path) -> None:
    """The staging cache of a DCP request is keyed by the cached plan (its skeleton): a
    steady save reuses the descriptors and copy plan, a re-planned one stages in full."""
    warnings.filterwarnings("ignore")
    cache = CheckpointMetadataCache()
    queue = AsyncCallsQueue()
    state = steady._dcp_state()
    try:
        _dcp_save_finalized(queue, state, tmp_path / "first", cache)
        staging = queue.persistent_caller.stage_cache
        for n, (what, change, reusable) in enumerate(steady.DCP_CHANGES):
            change(state)
            hits = staging.hits
            _dcp_save_finalized(queue, state, tmp_path / f"d{n}", cache)
            if what not in _MOVED:
                assert staging.hits == hits + reusable, what
    finally:
        queue.close()


@pytest.mark.timeout(120)
def test_a_model_and_optimizer_state_is_planned_at_its_first_save_only(tmp_path) -> None:
    """``get_state_dict(model, optimizer)`` makes new objects every call (new dicts, new
    detached tensors over the same storages): still one plan, and from the second save on
    the staging of the last save too."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    cache = CheckpointMetadataCache()
    queue = AsyncCallsQueue()
    try:
        for n in range(3):
            model(torch.rand(3, 4)).sum().backward()
            optim.step()
            optim.param_groups[0]["lr"] *= 0.5
            model_sd, optim_sd = get_state_dict(model, optim)
            state = {"model": model_sd, "optim": optim_sd, "step": n}
            _dcp_save_finalized(queue, state, tmp_path / f"s{n}", cache)
            assert _counts(cache) == (n, 1), n
        assert _counts(queue.persistent_caller.stage_cache) == (2, 1)
    finally:
        queue.close()


@pytest.mark.timeout(120)
def test_deferred_planning_keeps_the_plan_cache(tmp_path) -> None:
    """Planning at staging decides the same: a steady save reuses the plan, a changed
    structure is planned in full, with a queue or through ``preload_fn`` without one."""
    cache = CheckpointMetadataCache()
    queue = AsyncCallsQueue()
    try:
        for k in range(3):
            writer, ret = deferred._plan(deferred._state(k + 1.0), tmp_path / f"q{k}", cache)
            save_fn, preload_fn, args = writer.get_save_function_and_args()
            finalize = [lambda ret=ret: save_state_dict_async_finalize(*ret)]
            queue.schedule_async_request(
                AsyncRequest(save_fn, args, finalize, preload_fn=preload_fn)
            )
            queue.maybe_finalize_async_calls(blocking=True)
        assert _counts(cache) == (2, 1)
    finally:
        queue.close()
    cache = CheckpointMetadataCache()
    for k in range(2):
        state = deferred._state(k + 2.0)
        if k == 1:
            state["w"]["p9"] = torch.ones(3)
        writer, ret = deferred._plan(state, tmp_path / f"p{k}", cache)
        save_fn, preload_fn, args = writer.get_save_function_and_args()
        finalize = [lambda ret=ret: save_state_dict_async_finalize(*ret)]
        AsyncRequest(save_fn, args, finalize, preload_fn=preload_fn).execute_sync()
    assert _counts(cache) == (0, 2)


@pytest.mark.timeout(120)
def test_warmup_async_save_plans_and_stages_ahead_of_the_first_save(tmp_path) -> None:
    warnings.filterwarnings("ignore")
    state = {f"w{i}": torch.full((5 + i,), float(i)) for i in range(8)}
    cache = CheckpointMetadataCache()
    queue = AsyncCallsQueue()
    try:
        warmup_async_save(state, queue, metadata_cache=cache, thread_count=2)
        assert _counts(cache) == (0, 1)
        for value in state.values():
            value.add_(1)
        _dcp_save_finalized(queue, state, tmp_path / "first", cache)
        assert _counts(cache) == (1, 1)
        assert _counts(queue.persistent_caller.stage_cache) == (1, 0)
    finally:
        queue.close()


def test_the_cached_metadata_reader_reads_a_checkpoint_once_until_it_changes(
    tmp_path, monkeypatch
) -> None:
    """Its metadata is unpickled once per file identity; a rewrite, a cleared cache or
    ``cache_metadata=False`` reads it again."""
    import resilient_ckpt.async_ckpt.cached_metadata_filesystem_reader as reader_mod
    from resilient_ckpt.async_ckpt.cached_metadata_filesystem_reader import (
        CachedMetadataFileSystemReader,
        clear_metadata_cache,
    )
    from tests.unit.test_dcp_writer_unit import _save

    clear_metadata_cache()
    loads: list = []
    unpickler = reader_mod._restricted_pickle
    real_load = unpickler.load
    monkeypatch.setattr(unpickler, "load", lambda f, **kw: (loads.append(1), real_load(f, **kw))[1])
    path = tmp_path / "ck"
    _save({"a": torch.ones(4)}, path)
    loads.clear()  # count only the reader's loads from here
    for _ in range(3):
        CachedMetadataFileSystemReader(str(path)).read_metadata()
    assert len(loads) == 1
    _save({"a": torch.full((4,), 5.0), "b": torch.ones(2)}, path)
    loads.clear()
    CachedMetadataFileSystemReader(str(path)).read_metadata()
    assert len(loads) == 1
    clear_metadata_cache(str(path))
    CachedMetadataFileSystemReader(str(path)).read_metadata()
    CachedMetadataFileSystemReader(str(path), cache_metadata=False).read_metadata()
    assert len(loads) == 3


# -- the staging cache ----------------------------------------------------------------------


@pytest.mark.parametrize("copy", ["memmove", "copy_"])
def test_the_staging_cache_hits_only_for_an_unchanged_layout(copy, monkeypatch) -> None:
    if copy == "copy_":  # every storage staged as a device storage is (see _copy)
        monkeypatch.setattr(_copy, "is_host", lambda storage: False)
    pool, cache = ArenaPool(1), StageCache()
    state = steady._state()
    pool.release(stage(("fn", state), pool, _never, cache=cache).arena.arena_id)
    assert _counts(cache) == (0, 1)
    for what, change, reusable in steady.CHANGES:
        change(state)
        hits = cache.hits
        pool.release(stage(("fn", state), pool, _never, cache=cache).arena.arena_id)
        assert cache.hits == hits + reusable, what
    pool.close()


def _second_hits(then) -> int:
    pool, cache = ArenaPool(2), StageCache()
    try:
        first = layouts._tensors()
        staged = stage(first, pool, _never, cache=cache)
        if staged.arena is not None:
            pool.release(staged.arena.arena_id)
        hits = cache.hits
        stage(then(first), pool, _never, cache=cache)
        return cache.hits - hits
    finally:
        pool.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("change", [None, *sorted(layouts.CHANGES)])
def test_every_change_of_layout_misses_the_staging_cache(change) -> None:
    def changed(tensors: list) -> list:
        tensors = list(tensors)
        if change is None:
            for t in tensors:
                t.data.add_(1)  # the values change, the layouts do not
        else:
            layouts.CHANGES[change](tensors)
        return tensors

    assert _second_hits(changed) == (change is None)


def test_tensors_pickled_by_value_never_hit_the_staging_cache() -> None:
    pool, cache = ArenaPool(1), StageCache()
    sparse = torch.eye(3).to_sparse()
    for i in range(3):
        conj = torch.ones(2, dtype=torch.cfloat).conj()
        for state in ({"dense": torch.ones(4) * i, "sparse": sparse * i}, [torch.ones(4), conj]):
            pool.release(stage(state, pool, _never, cache=cache).arena.arena_id)
    assert cache.hits == 0
    pool.close()


def test_lists_of_tensors_hit_however_they_are_split() -> None:
    pool, cache = ArenaPool(1), StageCache()
    base = torch.arange(12, dtype=torch.float32)
    tensors = [base, base[2:6], torch.nn.Parameter(torch.ones(3)), torch.full((2, 2), 5.0)]
    for n, split in enumerate((2, 2, 3, 3)):
        hits = cache.hits
        staged = stage(steady._lists(split, tensors), pool, _never, cache=cache)
        pool.release(staged.arena.arena_id)
        assert cache.hits == hits + (n > 0), f"save {n}"
    pool.close()


@pytest.mark.timeout(60)
def test_a_tensor_met_twice_and_an_alias_of_it_are_told_apart_by_the_staging_cache() -> None:
    """A tensor met twice is one entry of the staged tensors, an alias two: each switch
    between the two stages fully."""
    from tests.unit.test_staging_identity import _Stager, _weights

    weights = _weights()
    apart = {"m": weights, "x": weights["w0"].detach()}
    twice = {"m": weights, "x": weights["w0"]}
    stager = _Stager()
    try:
        for i, (state, hit) in enumerate(
            [(apart, False), (apart, True), (twice, False), (twice, True), (apart, False)]
        ):
            hits = stager.cache.hits
            stager(state, cached=True)
            assert stager.cache.hits == hits + hit, i
    finally:
        stager.close()


@pytest.mark.timeout(120)
def test_the_torch_flow_hits_the_staging_cache_only_for_an_unchanged_layout(tmp_path) -> None:
    ckpt = TorchAsyncCheckpoint(copy_threads=2)
    try:
        state = steady._state()
        ckpt.async_save(state, str(tmp_path / "first.pt"))
        ckpt.finalize_async_save(blocking=True)
        cache = ckpt.queue.persistent_caller.stage_cache
        for n, (what, change, reusable) in enumerate(steady.CHANGES):
            change(state)
            hits = cache.hits
            ckpt.async_save(state, str(tmp_path / f"{n}.pt"), overlap_staging=n % 2 == 1)
            ckpt.finalize_async_save(blocking=True)
            assert cache.hits == hits + reusable, what
    finally:
        ckpt.close()


@pytest.mark.timeout(120)
def test_warmup_primes_the_staging_cache_for_the_state_it_is_given(tmp_path) -> None:
    for warm_state, hit in (("same", True), ("other", False)):
        ckpt = TorchAsyncCheckpoint()
        try:
            state = steady._state()
            ckpt.warmup(state if warm_state == "same" else {"x": torch.ones(3)})
            cache = ckpt.queue.persistent_caller.stage_cache
            assert _counts(cache) == (0, 0)  # a warm-up saves nothing
            state["w0"].add_(1)
            ckpt.async_save(state, str(tmp_path / f"{warm_state}.pt"))
            ckpt.finalize_async_save(blocking=True)
            assert _counts(cache) == (hit, not hit), warm_state
        finally:
            ckpt.close()


def _count_typed_views(monkeypatch) -> list:
    monkeypatch.setattr(_copy, "is_host", lambda storage: False)  # device copies, on CPU
    kept: list = []
    keep = Arena.keep_views
    monkeypatch.setattr(Arena, "keep_views", lambda self, *a: kept.append(1) or keep(self, *a))
    return kept


def test_device_copies_are_planned_once_over_the_arenas_typed_views(monkeypatch) -> None:
    kept = _count_typed_views(monkeypatch)
    base = torch.arange(8.0)
    state = {"w": torch.randn(4, 5), "v": base[2:6], "b": base, "t": torch.randn(5, 4).t()}
    pool, cache = ArenaPool(1), StageCache()
    for _ in range(4):
        pool.release(stage(("fn", state), pool, _never, cache=cache).arena.arena_id)
    assert (*_counts(cache), len(kept)) == (3, 1, 1)
    pool.close()


@pytest.mark.timeout(120)
def test_warmup_builds_the_typed_views_the_first_save_reuses(tmp_path, monkeypatch) -> None:
    kept = _count_typed_views(monkeypatch)
    ckpt = TorchAsyncCheckpoint()
    try:
        state = steady._state()
        ckpt.warmup(state)
        assert len(kept) == 1
        for n in range(3):
            ckpt.async_save(state, str(tmp_path / f"{n}.pt"))
            ckpt.finalize_async_save(blocking=True)
        cache = ckpt.queue.persistent_caller.stage_cache
        assert (*_counts(cache), len(kept)) == (3, 0, 1)
    finally:
        ckpt.close()


@pytest.mark.parametrize("threads", [1, 3])
def test_consecutive_tensors_are_copied_as_few_ranges(threads: int) -> None:
    """Allocated one after another, 300 tensors (~10 MB: above the parallel threshold, so
    with 3 threads the runs are cut into one share per thread) are copied as far fewer
    ranges than storages, in the staging cache's copy plan."""
    state = {"params": [torch.randn(8000 + k) for k in range(300)]}
    pool, cache = ArenaPool(1), StageCache()
    pool.release(stage(state, pool, _never, cache=cache, threads=threads).arena.arena_id)
    assert len(cache._shares) == threads
    segments = sum(len(share) for share in cache._shares)
    assert segments < 100, segments
    pool.close()


# -- the local shard layout -----------------------------------------------------------------


def _plan(cache: ShardPlanCache, state: dict) -> tuple[int, int, int]:
    plan_shard(BasicTensorAwareStateDict(state), cache)
    return cache.hits, cache.refreshes, cache.misses


def test_a_local_save_with_new_plain_values_only_refreshes_the_header() -> None:
    state = shards._state()
    cache = ShardPlanCache()
    assert _plan(cache, state) == (0, 0, 1)
    changes = [
        lambda: state.update(step=2),
        lambda: state["optim"]["state"][0].update(step=7),
        lambda: state["config"].update(name="run2"),  # through both references
        lambda: state.update(step=10**40),  # a longer pickle: the data moves
    ]
    for n, change in enumerate(changes, start=1):
        change()
        assert _plan(cache, state) == (n, n, 1)
    assert _plan(cache, state) == (len(changes) + 1, len(changes), 1)  # the same values


def test_a_local_save_with_a_changed_structure_plans_in_full() -> None:
    state = shards._state()
    cache = ShardPlanCache()
    _plan(cache, state)
    state["step"] = 2.5  # an int became a float
    assert _plan(cache, state) == (0, 0, 2)
    state["model"]["layer3.w"] = torch.rand(5)
    assert _plan(cache, state) == (0, 0, 3)


def test_a_training_state_refreshes_until_its_sharing_or_module_attributes_change() -> None:
    state = shards._training_state()
    config = {"name": "run", "sizes": (1, 2)}
    state.update(config=config, config_again=dict(config))
    cache = ShardPlanCache()
    _plan(cache, state)
    changes = [
        lambda: state.update(config_again=config),  # now the same object twice
        lambda: state.update(config_again=dict(config)),  # and two again
        lambda: state["optim"]["state"][0].update(note="warm"),  # not only tensors now
        lambda: state["model"]._metadata[""].update(version=2),  # type: ignore[attr-defined]
    ]
    for step, change in enumerate(changes, start=2):
        state["step"] = step
        assert _plan(cache, state) == (step - 1, step - 1, step - 1), f"refresh {step}"
        change()
        assert _plan(cache, state) == (step - 1, step - 1, step), f"change {step}"


def test_a_popped_state_reuses_its_records_until_a_tensor_changes() -> None:
    """A state planned in full at every save (Megatron's, here a ``ListState``) reuses the
    records while its tensors are described as before, and makes them again after each
    change of the behaviour tests' table."""
    tensors = [torch.rand(4) for _ in range(6)]
    cache = ShardPlanCache()
    for iteration in (1, 2, 3):
        plan_shard(_helpers.ListState([t.clone() for t in tensors], iteration), cache)
    assert _counts(cache) == (2, 1) and cache.refreshes == 2
    for n, (what, change) in enumerate(records.CHANGES, start=2):
        change(tensors)
        plan_shard(_helpers.ListState(tensors, n), cache)
        assert _counts(cache) == (2, n), what


# -- across ranks ---------------------------------------------------------------------------


class _CountingPlanner(DefaultSavePlanner):
    """Counts the global plans the coordinator makes (a planner the caller hands in)."""

    global_plans = 0

    def create_global_plan(self, all_plans):
        _CountingPlanner.global_plans += 1
        return super().create_global_plan(all_plans)


def _count_planning_collectives() -> collections.Counter:
    """Count the planning's agreements with the coordinator (``_dist.decide``: the global
    plan, the decentralized metadata); returns the live counter."""
    from resilient_ckpt import _dist

    counts: collections.Counter = collections.Counter()
    original = _dist.decide

    def counted(what, *args, **kwargs):
        if what.startswith("DCP save planning"):
            counts[what] += 1
        return original(what, *args, **kwargs)

    _dist.decide = counted  # type: ignore[assignment]
    return counts


def _write_and_commit(writer: Any, planned: tuple) -> None:
    """Write a planned save and commit it, in this process."""
    save_fn, _, args = writer.get_save_function_and_args()
    commit = [lambda: save_state_dict_async_finalize(*planned)]
    AsyncRequest(save_fn, args, commit).execute_sync()


def _plan_per_save(rank: int, world: int, root: str) -> list[tuple[int, int, int, int]]:
    """Five saves; rank 1 alone adds a tensor before the fourth. Per save: the plan cache's
    hits and misses, torch's planning collectives and the coordinator's global plans."""
    from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
    from resilient_ckpt.async_ckpt.state_dict_saver import save_state_dict_async_plan

    warnings.filterwarnings("ignore")
    counts = _count_planning_collectives()
    cache = CheckpointMetadataCache()
    state = {f"r{rank}.w{i}": torch.full((4 + i,), float(rank)) for i in range(6)}
    out = []
    for i in range(5):
        if i == 3 and rank == 1:
            state["r1.added"] = torch.ones(5)
        before = (*_counts(cache), sum(counts.values()), _CountingPlanner.global_plans)
        writer = FileSystemWriterAsync(f"{root}/s{i}", thread_count=1)
        ret = save_state_dict_async_plan(
            state, writer, planner=_CountingPlanner(), enable_cache=True, metadata_cache=cache
        )
        after = (*_counts(cache), sum(counts.values()), _CountingPlanner.global_plans)
        out.append(tuple(b - a for a, b in zip(before, after, strict=True)))
        _write_and_commit(writer, ret)
    return out


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_a_steady_save_plans_nothing_on_any_rank_and_a_change_on_one_replans_all(
    tmp_path,
) -> None:
    """A steady save runs no planning collective and no global plan; the first save, and
    the save after one rank changed its structure, plan on every rank (no rank may reuse a
    plan the others abandoned) and once on the coordinator."""
    for rank, per_save in enumerate(launch(_plan_per_save, 2, str(tmp_path))):
        for i, (hits, misses, collectives, plans) in enumerate(per_save):
            where = f"rank {rank}, save {i}"
            if i in (0, 3):
                assert (hits, misses) == (0, 1) and collectives >= 1, (where, per_save)
                assert plans == (rank == 0), (where, per_save)
            else:
                assert (hits, misses, collectives, plans) == (1, 0, 0, 0), (where, per_save)


def _tiered_first_save(rank: int, world: int, root: str) -> tuple[int, int]:
    """The plan cache's (hits, misses) of the first save after a tiered warm-up."""
    from tests.tiered._app import App, train
    from tests.tiered._jobs import manager

    app = App()
    train(app, 1)
    mgr = manager(root, durable_every=1)
    try:
        mgr.warmup(app.checkpoint())
        hits, misses = _counts(mgr._cache)
        mgr.save(app.checkpoint(), 1)
        mgr.maybe_finalize(blocking=True)
        return mgr._cache.hits - hits, mgr._cache.misses - misses
    finally:
        mgr.close()


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_the_tiered_warmup_plans_the_first_save_ahead(tmp_path) -> None:
    """``TieredCheckpointManager.warmup`` (and so the Lightning tiered callback's): the
    first save reuses the warm-up's plan on every rank."""
    for rank, counts in enumerate(launch(_tiered_first_save, 2, str(tmp_path))):
        assert counts == (1, 0), f"rank {rank}: the first save planned again: {counts}"


def _sharded_plan_per_save(rank: int, world: int, root: str) -> list[tuple[int, int]]:
    """The plan cache's (hits, misses) of each save of ``SHARDED_STEPS``."""
    from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
    from resilient_ckpt.async_ckpt.state_dict_saver import save_state_dict_async_plan
    from tests.dist import test_steady_state_dist as sharded

    warnings.filterwarnings("ignore")
    rows = 2
    state: dict = {"st": sharded._sharded(rank, world, rows, 1.0), f"r{rank}.w": torch.ones(3)}
    state["step"] = 0
    cache = CheckpointMetadataCache()
    out = []
    for n, (_what, change, _reused) in enumerate(sharded.SHARDED_STEPS):
        if change == "reshard":
            rows += 1
            state["st"] = sharded._sharded(rank, world, rows, 1.0)
        elif change == "add" and rank == 0:
            state["r0.extra"] = torch.full((4,), 4.0)
        elif change == "step":
            state["step"] = 42
        hits, misses = _counts(cache)
        writer = FileSystemWriterAsync(f"{root}/s{n}", thread_count=1)
        ret = save_state_dict_async_plan(
            state,
            writer,
            planner=sharded.OwnSetUpPlanner(),
            enable_cache=True,
            metadata_cache=cache,
        )
        out.append((cache.hits - hits, cache.misses - misses))
        _write_and_commit(writer, ret)
    return out


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_sharded_tensors_and_an_own_planner_reuse_the_plan_only_while_unchanged(
    tmp_path,
) -> None:
    """ShardedTensors are part of the structure key, and a planner with its own set-up
    keeps the cache: an unchanged state reuses the plan on every rank; a reshard, or a
    tensor added on one rank, re-plans on every rank."""
    from tests.dist.test_steady_state_dist import SHARDED_STEPS

    for rank, per_save in enumerate(launch(_sharded_plan_per_save, 2, str(tmp_path))):
        for (what, _change, reused), counts in zip(SHARDED_STEPS, per_save, strict=True):
            assert counts == (reused, not reused), f"rank {rank}, {what}: {counts}"
