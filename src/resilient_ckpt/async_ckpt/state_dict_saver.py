"""Plan and finalize an asynchronous DCP save, with a self-validating plan cache.

A DCP save is split in three (NVRx's protocol): :func:`save_state_dict_async_plan` plans
and prepares the write (trainer, collective); the write runs in the background (the
writer's save function in an ``AsyncRequest``); :func:`save_state_dict_async_finalize`
gathers every rank's outcome and commits (trainer, collective, from a finalize function).

Planning is the expensive collective part: every rank's local plan goes to the coordinator,
which builds the global plan and the metadata and scatters the plans back. For a state whose
structure does not change between saves the result is the same every time, so it is cached
(``enable_cache=True``). Unlike NVRx, the cache is *revalidated on every save*: each rank
computes a structure signature of its state (:mod:`._structure`: keys, shapes, dtypes,
sharding, planner settings) and one all-gather of two small integers per rank on a gloo group
decides, identically everywhere, whether every rank's signature equals the cached one. If
not, all ranks re-plan and the cache is replaced, so a changed model never reuses a stale
plan. The same collective carries "my set-up failed", so a bad directory on one rank makes
every rank raise instead of leaving the others waiting in a collective.

Finalize uses torch's ``_DistWrapper.all_reduce``: outcomes are gathered on the coordinator;
if any rank failed, every rank raises ``torch.distributed.checkpoint.CheckpointException``
naming the failed rank(s) and nothing is committed; otherwise the coordinator writes the
commit record and its success or failure is broadcast, so every rank learns the outcome.
"""

from __future__ import annotations

import copy
import inspect
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.api import _wrap_exception
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.distributed.checkpoint.utils import _DistWrapper

from .._logging import get_logger
from ..config import default_timeouts
from ..errors import CheckpointingException, ConfigurationError, InvalidRequestError
from . import _completion
from ._structure import check_state_dict, planner_settings, structure_signature

logger = get_logger(__name__)

__all__ = [
    "CheckpointMetadataCache",
    "get_metadata_caching_status",
    "init_checkpoint_metadata_cache",
    "save_state_dict_async_finalize",
    "save_state_dict_async_plan",
    "verify_global_md_reuse",
]


class CheckpointMetadataCache:
    """Plans and global metadata of the last full planning, reused while valid.

    Attributes (NVRx names): ``cached_central_plan`` (this rank's final plan),
    ``cached_local_plan``, ``cached_global_metadata`` (coordinator only),
    ``validated_cache_reuse`` (the last save reused the cached plan),
    ``validated_loaded_metadata_reuse`` (the last decentralized save reused metadata loaded
    from a previous checkpoint), ``loaded_all_plans`` (from that metadata). Ours:
    ``structure_signature`` (of the state the cache was built for), ``hits``, ``misses``.
    """

    def __init__(self) -> None:
        self.cached_central_plan: SavePlan | None = None
        self.cached_local_plan: SavePlan | None = None
        self.cached_global_metadata: Metadata | None = None
        self.validated_cache_reuse = False
        self.validated_loaded_metadata_reuse = False
        self.loaded_all_plans: list[SavePlan] | None = None
        self.structure_signature: bytes | None = None
        self.hits = 0
        self.misses = 0

    def set_cached_global_metadata(self, cached_global_metadata: Metadata) -> None:
        """Metadata loaded from a previous checkpoint (for decentralized planners)."""
        self.cached_global_metadata = cached_global_metadata
        self.loaded_all_plans = getattr(cached_global_metadata, "all_local_plans", None)
        if self.loaded_all_plans is None:
            logger.debug("metadata has no all_local_plans: its reuse cannot be verified")

    def set_cache_metadata(
        self, central_plan: SavePlan, local_plan: SavePlan, global_md_verify_reuse: bool
    ) -> None:
        """NVRx-compatible update: remember the plans; valid if the plan did not change."""
        self.validated_loaded_metadata_reuse = global_md_verify_reuse
        self.validated_cache_reuse = central_plan == self.cached_central_plan
        self.cached_central_plan = central_plan
        self.cached_local_plan = local_plan

    def prepare_save_state_dict_ret(
        self, rank: int, coordinator: int, save_state_dict_ret: tuple
    ) -> tuple:
        """NVRx-compatible: put the cached metadata in the plan result on the coordinator."""
        writer, global_metadata, *rest = save_state_dict_ret
        reusable = self.validated_cache_reuse or (
            self.validated_loaded_metadata_reuse and self.loaded_all_plans
        )
        if global_metadata is not None:
            self.cached_global_metadata = global_metadata
        elif reusable and rank == coordinator:
            global_metadata = self.cached_global_metadata
        return (writer, global_metadata, *rest)

    def get_cache_metadata(self) -> tuple[Any, Any, bool, Any]:
        return (
            self.cached_central_plan,
            self.cached_local_plan,
            self.validated_cache_reuse,
            self.loaded_all_plans,
        )

    def get_metadata_caching_status(self) -> tuple[bool, bool]:
        return self.validated_cache_reuse, self.validated_loaded_metadata_reuse

    def matches(self, signature: bytes, is_coordinator: bool) -> bool:
        """Whether the cached plan was built for a state with this signature."""
        if self.structure_signature != signature or self.cached_central_plan is None:
            return False
        return self.cached_global_metadata is not None or not is_coordinator

    def remember(
        self,
        signature: bytes | None,
        central_plan: SavePlan,
        local_plan: SavePlan | None,
        global_metadata: Metadata | None,
    ) -> None:
        """Replace the cache by the result of a full planning."""
        self.structure_signature = signature
        self.cached_central_plan = central_plan
        self.cached_local_plan = local_plan
        if global_metadata is not None:
            self.cached_global_metadata = global_metadata
        self.validated_cache_reuse = False
        self.misses += 1

    def invalidate(self) -> None:
        self.structure_signature = None
        self.cached_central_plan = None
        self.validated_cache_reuse = False


_checkpoint_metadata_cache: CheckpointMetadataCache | None = None


def init_checkpoint_metadata_cache(cached_global_metadata: Metadata) -> None:
    """Create the process-wide cache (once) and seed it with a loaded checkpoint's metadata."""
    global _checkpoint_metadata_cache
    if _checkpoint_metadata_cache is None:
        _checkpoint_metadata_cache = CheckpointMetadataCache()
    _checkpoint_metadata_cache.set_cached_global_metadata(cached_global_metadata)


def get_metadata_caching_status() -> tuple[bool, bool] | None:
    """``(validated_cache_reuse, validated_loaded_metadata_reuse)`` of the process-wide cache."""
    if _checkpoint_metadata_cache is None:
        return None
    return _checkpoint_metadata_cache.get_metadata_caching_status()


# -- small collectives on a CPU group -------------------------------------------------------


def _cpu_group(dist_wrapper: _DistWrapper) -> Any:
    """A gloo-capable group over the planning ranks, or None (then object collectives)."""
    group = dist_wrapper.group
    if group is None or group == dist.group.WORLD:
        return _completion.library_group(default_timeouts().collective)
    return group if "gloo" in str(dist.get_backend(group)).lower() else None


def _all_gather_ints(values: list[int], dist_wrapper: _DistWrapper) -> list[list[int]]:
    """Every planning rank's ``values``, in group-rank order (one collective)."""
    if not dist_wrapper.use_dist or dist_wrapper.get_world_size() == 1:
        return [values]
    group = _cpu_group(dist_wrapper)
    if group is None:
        return dist_wrapper.all_gather_object(values)
    mine = torch.tensor(values, dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(dist_wrapper.get_world_size())]
    dist.all_gather(gathered, mine, group=group)
    return [[int(v) for v in t.tolist()] for t in gathered]


def _agree(ok: bool, error: BaseException | None, dist_wrapper: _DistWrapper, step: str) -> bool:
    """True iff ``ok`` on every rank; raise ``CheckpointException`` everywhere on any error."""
    flags = _all_gather_ints([int(ok), int(error is not None)], dist_wrapper)
    failed = [rank for rank, (_, bad) in enumerate(flags) if bad]
    if failed:
        failures = {}
        for rank in failed:
            exc = error if rank == dist_wrapper.rank and error is not None else None
            failures[rank] = _wrap_exception(
                exc or CheckpointingException(f"rank {rank} failed in {step}; see its error")
            )
        raise CheckpointException(step, failures) from error
    return all(good for good, _ in flags)


def _plan_matches_loaded(
    loaded_all_plans: list[SavePlan] | None, local_plan: SavePlan, rank: int, world_size: int
) -> bool:
    if not loaded_all_plans or len(loaded_all_plans) != world_size:
        return False
    loaded = loaded_all_plans[rank]
    return all(
        getattr(local_plan, f.name) == getattr(loaded, f.name)
        for f in fields(local_plan)
        if f.name != "storage_data"
    )


def verify_global_md_reuse(
    loaded_all_plans: list[SavePlan], local_plan: SavePlan, rank: int, dist_wrapper: _DistWrapper
) -> bool:
    """True iff every rank's local plan equals its plan in the loaded metadata (collective,
    on gloo; only when the loaded plans cover every rank)."""
    if not loaded_all_plans or len(loaded_all_plans) != dist_wrapper.get_world_size():
        return False
    ok = _plan_matches_loaded(loaded_all_plans, local_plan, rank, dist_wrapper.get_world_size())
    return _agree(ok, None, dist_wrapper, "verify_global_md_reuse")


# -- planning -------------------------------------------------------------------------------


def _check_writer(storage_writer: Any) -> None:
    if not isinstance(storage_writer, StorageWriter):
        raise ConfigurationError(
            f"storage_writer must be a torch.distributed.checkpoint.StorageWriter (e.g. "
            f"FileSystemWriterAsync), got {type(storage_writer).__name__}"
        )
    needed = ("prepare_write_data", "get_save_function_and_args", "retrieve_write_results")
    missing = [name for name in needed if not callable(getattr(storage_writer, name, None))]
    if missing:
        raise ConfigurationError(
            f"{type(storage_writer).__name__} cannot write asynchronously (no {missing}); "
            "use resilient_ckpt.async_ckpt.filesystem_async.FileSystemWriterAsync"
        )


def _resolve_cache(
    enable_cache: bool, metadata_cache: CheckpointMetadataCache | None
) -> CheckpointMetadataCache | None:
    global _checkpoint_metadata_cache
    if not enable_cache:
        return None
    if metadata_cache is not None:
        return metadata_cache
    if _checkpoint_metadata_cache is None:
        _checkpoint_metadata_cache = CheckpointMetadataCache()
    return _checkpoint_metadata_cache


class _Planning:
    """The planning steps of one save, in the order torch's ``save`` runs them."""

    def __init__(
        self,
        state_dict: STATE_DICT_TYPE,
        writer: Any,
        planner: SavePlanner,
        dist_wrapper: _DistWrapper,
    ) -> None:
        self.state_dict = state_dict
        self.writer = writer
        self.planner = planner
        self.dist_wrapper = dist_wrapper
        self.is_set_up = False
        self.local_plan: SavePlan | None = None
        self.global_metadata: Metadata | None = None

    def set_up(self) -> None:
        coordinator = self.dist_wrapper.is_coordinator
        if "storage_meta" in inspect.signature(self.planner.set_up_planner).parameters:
            self.planner.set_up_planner(
                self.state_dict,
                storage_meta=self.writer.storage_meta(),
                is_coordinator=coordinator,
            )
        else:
            self.planner.set_up_planner(self.state_dict, is_coordinator=coordinator)
        if "kwargs" in inspect.signature(self.writer.set_up_storage_writer).parameters:
            self.writer.set_up_storage_writer(
                coordinator, rank=self.dist_wrapper.rank, use_collectives=True
            )
        else:
            self.writer.set_up_storage_writer(coordinator)
        self.is_set_up = True

    def signature(self) -> bytes:
        flat = getattr(self.planner, "state_dict", None)
        if not isinstance(flat, Mapping):
            from torch.distributed.checkpoint._nested_dict import flatten_state_dict

            flat, _ = flatten_state_dict(self.state_dict)
        group = self.dist_wrapper.group
        context = (
            f"{type(self.planner).__module__}.{type(self.planner).__qualname__}",
            planner_settings(self.planner),
            f"{type(self.writer).__module__}.{type(self.writer).__qualname__}",
            self.dist_wrapper.get_world_size(),
            self.dist_wrapper.rank,
            self.dist_wrapper.coordinator_rank,
            None if group is None else dist.get_process_group_ranks(group),
        )
        return structure_signature(flat, context)

    def local_step(self) -> SavePlan:
        if not self.is_set_up:
            self.set_up()
        plan = self.planner.create_local_plan()
        self.local_plan = self.writer.prepare_local_plan(plan)
        return self.local_plan

    def global_step(self, all_local_plans: list[SavePlan]) -> list[SavePlan]:
        all_local_plans, self.global_metadata = self.planner.create_global_plan(all_local_plans)
        return self.writer.prepare_global_plan(all_local_plans)

    def revalidate(self, cache: CheckpointMetadataCache) -> tuple[bool, bytes | None]:
        """Set up, then agree with every rank whether the cached plan still fits."""
        signature: bytes | None = None
        matches, error = False, None
        try:
            self.set_up()
            signature = self.signature()
            matches = cache.matches(signature, self.dist_wrapper.is_coordinator)
        except Exception as exc:
            error = exc
        return _agree(matches, error, self.dist_wrapper, "plan"), signature

    def plan_centrally(self) -> SavePlan:
        return self.dist_wrapper.reduce_scatter("plan", self.local_step, self.global_step)

    def plan_decentralized(self, cache: CheckpointMetadataCache | None) -> tuple[SavePlan, bool]:
        """Local plans gathered only for the metadata (or not at all when the loaded
        metadata still fits); each rank finalizes its own plan."""
        loaded = cache.loaded_all_plans if cache is not None else None
        dw = self.dist_wrapper
        matches, error = False, None
        try:
            local_plan = self.local_step()
            matches = _plan_matches_loaded(loaded, local_plan, dw.rank, dw.get_world_size())
        except Exception as exc:
            error = exc
        reuse_loaded = _agree(matches, error, dw, "plan") and bool(loaded)
        if reuse_loaded and cache is not None and dw.is_coordinator:
            self.global_metadata = cache.cached_global_metadata
        elif not reuse_loaded:
            all_local_plans = dw.gather_object(local_plan)
            if dw.is_coordinator and all_local_plans is not None:
                _, metadata = self.planner.create_global_plan(all_local_plans)
                metadata.all_local_plans = all_local_plans  # type: ignore[attr-defined]
                self.global_metadata = metadata
        plan = self.planner.create_decentralized_global_plan(local_plan)  # type: ignore[attr-defined]
        return self.writer.prepare_decentralized_global_plan(plan), reuse_loaded


def _decentralized(planner: Any, writer: Any) -> bool:
    return bool(getattr(planner, "can_run_decentralized_global_plan", False)) and bool(
        getattr(writer, "can_run_decentralized_global_plan", False)
    )


def save_state_dict_async_plan(
    state_dict: STATE_DICT_TYPE,
    storage_writer: Any,
    process_group: dist.ProcessGroup | None = None,
    coordinator_rank: int = 0,
    planner: SavePlanner | None = None,
    enable_cache: bool = False,
    metadata_cache: CheckpointMetadataCache | None = None,
) -> tuple[Any, Metadata | None, _DistWrapper]:
    """Plan a DCP save and prepare the writer's background write (collective, all ranks).

    Returns ``(storage_writer, global_metadata, dist_wrapper)``, to be passed unchanged to
    :func:`save_state_dict_async_finalize`; ``global_metadata`` is None except on the
    coordinator. With ``enable_cache`` (on every rank alike) the plan of the previous save is
    reused while the state's structure is unchanged on every rank (one small gloo collective
    per save checks it); ``metadata_cache`` defaults to the process-wide cache.
    """
    check_state_dict(state_dict)
    _check_writer(storage_writer)
    use_dist = dist.is_available() and dist.is_initialized()
    dist_wrapper = _DistWrapper(process_group, use_dist, coordinator_rank)
    planner = planner if planner is not None else DefaultSavePlanner()
    cache = _resolve_cache(enable_cache, metadata_cache)
    planning = _Planning(state_dict, storage_writer, planner, dist_wrapper)
    started = time.perf_counter()
    hit, signature, reused_loaded = False, None, False
    if cache is not None:
        hit, signature = planning.revalidate(cache)
    if hit and cache is not None and cache.cached_central_plan is not None:
        central_plan = cache.cached_central_plan
    elif _decentralized(planner, storage_writer):
        central_plan, reused_loaded = planning.plan_decentralized(cache)
    else:
        central_plan = planning.plan_centrally()
    central_plan = planner.finish_plan(central_plan)
    global_metadata = _update_cache(cache, hit, signature, central_plan, planning, reused_loaded)
    plan_s = time.perf_counter() - started
    storage_writer.prepare_write_data(central_plan, planner)
    logger.info(
        "planned save to %s in %.4fs (%s), prepared write in %.4fs",
        getattr(storage_writer, "checkpoint_id", "?"),
        plan_s,
        "cached plan" if hit else "full planning",
        time.perf_counter() - started - plan_s,
    )
    return storage_writer, global_metadata, dist_wrapper


def _update_cache(
    cache: CheckpointMetadataCache | None,
    hit: bool,
    signature: bytes | None,
    central_plan: SavePlan,
    planning: _Planning,
    reused_loaded: bool,
) -> Metadata | None:
    """Record this save in the cache; return the coordinator's metadata for this save.

    The cache keeps pristine objects; each save gets a shallow copy, because ``finish``
    fills in the copy's storage data.
    """
    is_coordinator = planning.dist_wrapper.is_coordinator
    if cache is None:
        return planning.global_metadata
    cache.validated_loaded_metadata_reuse = reused_loaded
    if hit:
        cache.validated_cache_reuse = True
        cache.hits += 1
        metadata = cache.cached_global_metadata if is_coordinator else None
    else:
        cache.remember(signature, central_plan, planning.local_plan, planning.global_metadata)
        metadata = planning.global_metadata
    return copy.copy(metadata) if metadata is not None else None


# -- finalize -------------------------------------------------------------------------------


@dataclass
class _RankOutcome:
    """What each rank contributes to the commit: its write results and file checksums."""

    write_results: list[WriteResult]
    file_checksums: dict[str, tuple[int, int]]


def save_state_dict_async_finalize(
    storage_writer: Any, global_metadata: Metadata | None, dist_wrapper: _DistWrapper
) -> None:
    """Gather every rank's write outcome and commit (collective, all ranks).

    Raises ``torch.distributed.checkpoint.CheckpointException`` on every rank when any
    rank's write failed (naming those ranks; nothing is committed) or the commit failed.
    """
    started = time.perf_counter()

    def collect() -> _RankOutcome:
        results = storage_writer.retrieve_write_results()
        return _RankOutcome(results, dict(getattr(storage_writer, "written_files", {}) or {}))

    def commit(outcomes: list[_RankOutcome]) -> None:
        _commit(storage_writer, global_metadata, outcomes)

    dist_wrapper.all_reduce("write", collect, commit)
    logger.info("finalized checkpoint save in %.4fs", time.perf_counter() - started)


def _commit(writer: Any, metadata: Metadata | None, outcomes: list[_RankOutcome]) -> None:
    if metadata is None:
        raise InvalidRequestError(
            "the coordinator has no global metadata to commit: pass the result of "
            "save_state_dict_async_plan to save_state_dict_async_finalize unchanged"
        )
    results = [outcome.write_results for outcome in outcomes]
    checksums: dict[str, tuple[int, int]] = {}
    for outcome in outcomes:
        checksums.update(outcome.file_checksums)
    if "file_checksums" in inspect.signature(writer.finish).parameters:
        writer.finish(metadata, results, file_checksums=checksums)
    else:
        writer.finish(metadata, results)
