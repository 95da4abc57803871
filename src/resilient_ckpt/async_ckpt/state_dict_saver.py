"""Plan and finalize an asynchronous DCP save, with a self-validating plan cache.

A DCP save is split in three (NVRx's protocol): :func:`save_state_dict_async_plan` plans
and prepares the write (trainer, collective); the write runs in the background (the
writer's save function in an ``AsyncRequest``); :func:`save_state_dict_async_finalize`
gathers every rank's outcome and commits (trainer, collective, from a finalize function).

Planning is the expensive collective part (every rank's local plan to the coordinator, the
global plan and metadata back). Its result depends on the state's structure only, so it is
cached (``enable_cache=True``) and, unlike NVRx, revalidated on every save with one small
collective (:mod:`._planning`): a change on any rank makes every rank re-plan, and a set-up
failure on any rank fails every rank instead of leaving the others in a collective.

Planning and finalize are each one agreement with a coordinator that acts
(:func:`.._dist.decide`, on the library's gloo group or the caller's sub-group): the local
plans are gathered on the coordinator, which makes the global plan and scatters each rank its
part; at finalize the write outcomes are gathered on the coordinator, which commits if no
rank failed. If any rank failed (or the coordinator's own step did), every rank raises
:class:`~resilient_ckpt.errors.RankFailureError` (a
``torch.distributed.checkpoint.CheckpointException`` too) naming the failed rank(s), and
nothing is committed. torch's ``_DistWrapper`` is still what the plan hands out (NVRx's
contract); here it only says which group, rank and coordinator.

Publishing a prepared ``.metadata`` instead of rebuilding it (NVRx's metadata reuse). A job
whose checkpoint structure does not change can keep the complete metadata of one save
(``save_state_dict_async_finalize(..., create_metadata_path=...)`` returns it and stores it)
and hand it to later finalizes (``reuse_metadata_obj=``), which publish it as the commit
record. That is only correct while every item still lands at the byte range the prepared
metadata records. Tensors are stored raw, so their ranges depend only on shape and dtype;
a non-tensor item is pickled and its length can change with its value (an optimizer's
integer ``step`` growing past a pickle size band), shifting it and every item after it in
its file. Publishing stale metadata would make a later load read the wrong bytes. So every
rank compares the write results of this save with the prepared metadata
(:func:`find_layout_mismatch`, local, both directions) and the finalize's one cross-rank
exchange carries the verdict; a mismatch on any rank fails the save on every rank, naming
the item, and no ``.metadata`` is written. Alternatives: trusting the caller (NVRx's first
version: silent corruption on drift), or rebuilding the metadata every time (the cost the
reuse avoids).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import pickle
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.checkpoint.utils import _DistWrapper

from .. import _dist, _telemetry
from .._logging import get_logger
from .._rank_errors import is_wrapped_failure
from ..errors import (
    CheckpointingException,
    ConfigurationError,
    InvalidRequestError,
    RemoteTraceback,
)
from ..storage.commit import write_atomically
from ._dcp_write import decode_results
from ._planning import (
    CheckpointMetadataCache,
    Planning,
    PlanRecord,
    accepts,
    cached_plan,
    is_decentralized,
    planning_ranks,
    structure_key,
    verify_global_md_reuse,
)
from ._structure import Structure
from .filesystem_async import FileSystemWriterAsync

logger = get_logger(__name__)

PlannedMetadata = Metadata | Future[Metadata | None] | None
"""What :func:`save_state_dict_async_plan` returns as ``global_metadata``: the coordinator's
metadata (None elsewhere), or for a deferred save the future of it (see there)."""


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic collector disabled for the ``with`` body (re-enabled after it, unless
    it was disabled already, by the user or an outer pause).

    Decision: a finalize of a save of thousands of tensors builds the checkpoint's metadata
    and every rank's write results: tens of thousands of objects that live a few
    milliseconds. With the collector running, its young-generation passes meet them alive and
    promote them, so the oldest generation grows every save, and every few saves Python runs
    a full collection over every object of the trainer, in whatever code runs next (often
    the next save's call). Paused, these objects die by reference counting before any pass
    sees them; nothing they form is cyclic. The pause is process-wide (Python has no
    per-thread collector), so it lasts the finalize's own duration only.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


__all__ = [
    "CheckpointMetadataCache",
    "get_metadata_caching_status",
    "init_checkpoint_metadata_cache",
    "save_state_dict_async_finalize",
    "save_state_dict_async_plan",
    "verify_global_md_reuse",
]


_checkpoint_metadata_cache: CheckpointMetadataCache | None = None


def init_checkpoint_metadata_cache(cached_global_metadata: Metadata | None = None) -> None:
    """Create the process-wide cache (once) and seed it with a loaded checkpoint's metadata
    (None, NVRx's default: nothing loaded)."""
    global _checkpoint_metadata_cache
    if _checkpoint_metadata_cache is None:
        _checkpoint_metadata_cache = CheckpointMetadataCache()
    _checkpoint_metadata_cache.set_cached_global_metadata(cached_global_metadata)


def get_metadata_caching_status() -> tuple[bool, bool] | None:
    """``(validated_cache_reuse, validated_loaded_metadata_reuse)`` of the process-wide cache."""
    if _checkpoint_metadata_cache is None:
        return None
    return _checkpoint_metadata_cache.get_metadata_caching_status()


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


def save_state_dict_async_plan(
    state_dict: STATE_DICT_TYPE,
    storage_writer: Any,
    process_group: dist.ProcessGroup | None = None,
    coordinator_rank: int = 0,
    planner: SavePlanner | None = None,
    enable_cache: bool = False,
    metadata_cache: CheckpointMetadataCache | None = None,
    *,
    defer_planning: bool = False,
) -> tuple[Any, PlannedMetadata, _DistWrapper]:
    """Plan a DCP save and prepare the writer's background write (collective, all ranks).

    Returns ``(storage_writer, global_metadata, dist_wrapper)``, to be passed unchanged to
    :func:`save_state_dict_async_finalize`; ``global_metadata`` is None except on the
    coordinator. With ``enable_cache`` (on every rank alike) the plan of the previous save is
    reused while the state's structure is unchanged on every rank (one small gloo collective
    per save checks it); ``metadata_cache`` defaults to the process-wide cache.

    ``defer_planning=True`` (needs ``enable_cache``; every rank alike; our extension of NVRx's
    call): from the second save on, the planning runs where the request is staged instead of
    here: with ``overlap_staging=True``, on the staging thread, so this call returns at once.
    The planning is the same; planning errors are raised by ``schedule_async_request`` or
    ``wait_for_snapshot`` instead of here (see :mod:`._staging`). Such a deferred save returns,
    on every rank, a ``concurrent.futures.Future`` as ``global_metadata``: set when the
    planning runs, to what this call would have returned (the coordinator's metadata, None
    elsewhere), or to its error. The finalize takes it as it is; :func:`planned_metadata`
    resolves it. The writer's ``get_save_function_and_args`` then hands out the planning as
    the ``preload_fn``. Needs a writer that supports it (``FileSystemWriterAsync``) and the
    default process group; otherwise the call plans, and returns what it does without it.
    """
    checkpoint = {_telemetry.CHECKPOINT: str(getattr(storage_writer, "checkpoint_id", ""))}
    with _telemetry.save_phase(_telemetry.PLAN_SPAN, "dcp", checkpoint):
        return _plan_save(
            state_dict,
            storage_writer,
            process_group,
            coordinator_rank,
            planner,
            enable_cache,
            metadata_cache,
            defer_planning,
        )


def _plan_save(
    state_dict: STATE_DICT_TYPE,
    storage_writer: Any,
    process_group: dist.ProcessGroup | None,
    coordinator_rank: int,
    planner: SavePlanner | None,
    enable_cache: bool,
    metadata_cache: CheckpointMetadataCache | None,
    defer_planning: bool,
) -> tuple[Any, PlannedMetadata, _DistWrapper]:
    use_dist = dist.is_available() and dist.is_initialized()
    dist_wrapper = _DistWrapper(process_group, use_dist, coordinator_rank)
    planner = planner if planner is not None else DefaultSavePlanner()
    cache = _resolve_cache(enable_cache, metadata_cache)
    if defer_planning:
        if cache is None:
            raise ConfigurationError(
                "defer_planning=True needs enable_cache=True: only a save whose plan is "
                "cached can be planned later"
            )
        if _can_defer(cache, storage_writer, planner, process_group):
            return _defer(state_dict, storage_writer, planner, dist_wrapper, cache)
    metadata = _plan(state_dict, storage_writer, planner, dist_wrapper, cache)
    return storage_writer, metadata, dist_wrapper


def _plan(
    state_dict: STATE_DICT_TYPE,
    storage_writer: Any,
    planner: SavePlanner,
    dist_wrapper: _DistWrapper,
    cache: CheckpointMetadataCache | None,
) -> Metadata | None:
    """Plan the save on ``dist_wrapper``'s group and prepare the writer; the coordinator's
    metadata of this save."""
    planning = Planning(state_dict, storage_writer, planner, dist_wrapper)
    started = time.perf_counter()
    prepare_s = 0.0

    def prepare(plan: SavePlan) -> SavePlan:
        nonlocal prepare_s
        finished = planner.finish_plan(plan)
        begun = time.perf_counter()
        storage_writer.prepare_write_data(finished, planner)
        prepare_s = time.perf_counter() - begun
        return finished

    central_plan, structure, key, reused_loaded = None, None, None, False
    # Every rank has planned as often as the others, so all take this branch or none.
    if cache is not None and cache.misses:
        central_plan, structure, key = cached_plan(planning, cache, prepare)
    elif cache is not None:
        structure, key = structure_key(planning)
    hit = central_plan is not None
    if central_plan is None:
        if is_decentralized(planner, storage_writer):
            loaded = cache.loaded_all_plans if cache is not None else None
            loaded_md = cache.cached_global_metadata if cache is not None else None
            central_plan, reused_loaded = planning.plan_decentralized(loaded, loaded_md)
        else:
            central_plan = planning.plan_centrally()
        central_plan = _prepare_agreed(prepare, central_plan, dist_wrapper)
    global_metadata = _update_cache(
        cache, hit, structure, key, central_plan, planning, reused_loaded
    )
    plan_s = time.perf_counter() - started - prepare_s
    logger.info(
        "planned save to %s in %.4fs (%s), prepared write in %.4fs",
        getattr(storage_writer, "checkpoint_id", "?"),
        plan_s,
        "cached plan" if hit else "full planning",
        prepare_s,
    )
    return global_metadata


def _prepare_agreed(
    prepare: Callable[[SavePlan], SavePlan], central_plan: SavePlan, dist_wrapper: _DistWrapper
) -> SavePlan:
    """Prepare the write of a fully planned save, then agree on it: a rank that cannot (a
    value that does not pickle) fails every rank here, not only itself while its peers go
    on to stage and finalize. (With a cached plan the plan cache's agreement carries it.)"""
    error: Exception | None = None
    try:
        central_plan = prepare(central_plan)
    except Exception as exc:
        error = exc
    _dist.agree("DCP save planning (preparing the write)", error, **planning_ranks(dist_wrapper))
    return central_plan


def _can_defer(
    cache: CheckpointMetadataCache, writer: Any, planner: Any, process_group: Any
) -> bool:
    """Whether this save's planning may run at staging: a plan is cached (the first save
    plans in the call, and so agrees on everything a later check compares against), the
    writer supports it, and the planning spans the default group (the background group's
    ranks). The same on every rank, as the planning history and the arguments are."""
    return (
        bool(cache.misses)
        and callable(getattr(writer, "defer_write_data", None))
        and not is_decentralized(planner, writer)
        and (process_group is None or process_group == dist.group.WORLD)
    )


def _defer(
    state_dict: STATE_DICT_TYPE,
    writer: Any,
    planner: SavePlanner,
    dist_wrapper: _DistWrapper,
    cache: CheckpointMetadataCache,
) -> tuple[Any, PlannedMetadata, _DistWrapper]:
    """Hand the writer this save's planning, to run when its request is staged; the metadata
    is the future of what that planning returns."""
    use_dist = dist_wrapper.use_dist
    several = use_dist and dist_wrapper.get_world_size() > 1
    group = _dist.background_group() if several else None  # collective on first use
    metadata: Future[Metadata | None] = Future()

    def plan() -> None:
        background = _DistWrapper(group, use_dist, dist_wrapper.coordinator_rank)
        try:
            planned = _plan(state_dict, writer, planner, background, cache)
        except BaseException as exc:
            metadata.set_exception(exc)
            raise
        metadata.set_result(planned)

    writer.defer_write_data(plan)
    return writer, metadata, dist_wrapper


def planned_metadata(global_metadata: PlannedMetadata) -> Metadata | None:
    """``global_metadata`` as :func:`save_state_dict_async_plan` returned it, a deferred save's
    future resolved: the coordinator's metadata, None elsewhere. Raises the planning's error
    if it failed, :class:`~resilient_ckpt.errors.InvalidRequestError` if it has not run."""
    if not isinstance(global_metadata, Future):
        return global_metadata
    if not global_metadata.done():
        raise InvalidRequestError(
            "the deferred planning of this save did not run: its request was not staged"
        )
    return global_metadata.result()


def _update_cache(
    cache: CheckpointMetadataCache | None,
    hit: bool,
    structure: Structure | None,
    key: tuple | None,
    central_plan: SavePlan,
    planning: Planning,
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
        record = None
        if structure is not None:
            record = PlanRecord.of(planning, structure, cache.misses + 1)
        tensors = structure.tensors if structure is not None else []
        cache.remember(
            key, tensors, record, central_plan, planning.local_plan, planning.global_metadata
        )
        metadata = planning.global_metadata
    return copy.copy(metadata) if metadata is not None else None


# -- finalize -------------------------------------------------------------------------------


class StaleMetadataError(CheckpointingException):
    """The prepared metadata no longer describes the bytes this save wrote."""


def find_layout_mismatch(
    write_results: list[WriteResult], prepared: Metadata
) -> tuple[str, str] | None:
    """``(fqn, detail)`` of the first difference between what this rank wrote and the
    prepared metadata, or None when this rank's part of the layout matches.

    Forward: every written item must be in the prepared metadata at the same
    ``(relative_path, offset, length)``. Reverse: every item the prepared metadata places
    in a file this rank wrote must have been written now (an item removed at the end of a
    file, or moved to another rank, shifts nothing this rank wrote). Items in files of
    other ranks are theirs to check.
    """
    expected_by_index = prepared.storage_data or {}
    written = set()
    own_files = set()
    for result in write_results:
        actual = result.storage_data
        written.add(result.index)
        own_files.add(actual.relative_path)
        expected = expected_by_index.get(result.index)
        if expected is None:
            return str(result.index.fqn), (
                "written by this save but absent from the prepared metadata (the checkpoint "
                "structure changed)"
            )
        want = (expected.relative_path, expected.offset, expected.length)
        got = (actual.relative_path, actual.offset, actual.length)
        if want != got:
            return str(result.index.fqn), (
                f"prepared (file, offset, length) = {want}, written = {got}: a non-tensor "
                "item's pickled size changed, or an item before it in the file did"
            )
    for index, info in expected_by_index.items():
        if info.relative_path in own_files and index not in written:
            return str(index.fqn), (
                f"in the prepared metadata at {info.relative_path} (offset {info.offset}, "
                f"length {info.length}) but not written by this save (removed or moved to "
                "another rank)"
            )
    return None


def _check_reuse_arguments(reuse_metadata_obj: Any, create_metadata_path: Any) -> None:
    if reuse_metadata_obj is not None and create_metadata_path is not None:
        raise ConfigurationError(
            "save_state_dict_async_finalize: reuse_metadata_obj and create_metadata_path "
            "exclude each other (creating needs the full metadata that reuse skips)"
        )
    if reuse_metadata_obj is not None and not isinstance(reuse_metadata_obj, Metadata):
        raise ConfigurationError(
            "reuse_metadata_obj must be the torch.distributed.checkpoint Metadata of an "
            f"earlier save, got {type(reuse_metadata_obj).__name__}"
        )


def _stale_error(rank: int, mismatch: tuple[str, str]) -> StaleMetadataError:
    fqn, detail = mismatch
    return StaleMetadataError(
        f"rank {rank}: the prepared metadata is stale for item {fqn!r}: {detail}. "
        "Nothing was committed; create the metadata again (create_metadata_path) or "
        "finalize without reuse_metadata_obj"
    )


def _share_created_metadata(writer: Any, dist_wrapper: _DistWrapper, path: str) -> Metadata:
    """After a full finalize: the complete metadata, read back by the coordinator, stored at
    ``path`` (atomically) for later jobs and given to every rank."""

    def read_and_store(_: list[None]) -> Metadata:
        metadata = writer.read_metadata()
        write_atomically(path, lambda f: pickle.dump(metadata, f))
        return metadata

    return _dist.decide(
        "storing the created metadata",
        None,
        None,
        read_and_store,
        coordinator=dist_wrapper.coordinator_rank,
        **planning_ranks(dist_wrapper),
    )


@dataclass
class _RankOutcome:
    """What each rank contributes to the commit: its file checksums and its write results,
    from our writers as ``rows`` (one encoded ``bytes`` per data file, decoded by the
    coordinator only), from others as ``WriteResult`` objects."""

    file_checksums: dict[str, tuple[int, int]]
    write_results: list[WriteResult] = field(default_factory=list)
    rows: list[bytes] | None = None

    def decoded(self) -> list[WriteResult]:
        if self.rows is None:
            return self.write_results
        return [result for encoded in self.rows for result in decode_results(encoded)]


def save_state_dict_async_finalize(
    storage_writer: Any,
    global_metadata: PlannedMetadata,
    dist_wrapper: _DistWrapper,
    reuse_metadata_obj: Metadata | None = None,
    create_metadata_path: str | None = None,
) -> Metadata | None:
    """Gather every rank's write outcome and commit (collective, all ranks).

    Raises :class:`~resilient_ckpt.errors.RankFailureError` (a
    ``torch.distributed.checkpoint.CheckpointException`` and a ``CheckpointingException``)
    on every rank when any rank's write failed (naming those ranks; nothing is committed)
    or the commit failed.

    ``reuse_metadata_obj``: publish this complete metadata of an earlier save of the same
    structure instead of building it, after every rank checked that its writes land where
    it says (see the module docstring; a stale one fails the save, nothing committed).
    ``create_metadata_path``: after the commit, store the complete metadata there and
    return it on every rank, for later ``reuse_metadata_obj``. Otherwise returns None.
    """
    _check_reuse_arguments(reuse_metadata_obj, create_metadata_path)
    started = time.perf_counter()

    def commit(outcomes: list[_RankOutcome]) -> None:
        if reuse_metadata_obj is None:
            _commit(storage_writer, global_metadata, outcomes)
            return
        checksums: dict[str, tuple[int, int]] = {}
        for outcome in outcomes:
            checksums.update(outcome.file_checksums)
        storage_writer.publish_metadata(copy.copy(reuse_metadata_obj), checksums or None)

    with _telemetry.span(_telemetry.COMMIT_SPAN), collector_paused():
        outcome, error = _rank_outcome(storage_writer, reuse_metadata_obj, dist_wrapper.rank)
        _dist.decide(
            "DCP save (write and commit)",
            error,
            outcome,
            commit,
            coordinator=dist_wrapper.coordinator_rank,
            **planning_ranks(dist_wrapper),
        )
    logger.info("finalized checkpoint save in %.4fs", time.perf_counter() - started)
    if create_metadata_path is not None:
        return _share_created_metadata(storage_writer, dist_wrapper, create_metadata_path)
    return None


def _rank_outcome(
    writer: Any, reuse_metadata_obj: Metadata | None, rank: int
) -> tuple[_RankOutcome | None, Exception | None]:
    """What this rank gives the commit, or why it cannot: its write failed (raised, or an
    NVRx-style writer's returned failure pair), or its writes do not land where the
    prepared metadata says."""
    compact = _compact_results(writer)
    try:
        results = compact() if compact is not None else writer.retrieve_write_results()
    except Exception as exc:
        return None, exc
    if is_wrapped_failure(results):
        return None, _returned_failure(results)
    checksums = dict(getattr(writer, "written_files", {}) or {})
    if compact is not None:
        outcome = _RankOutcome(checksums, rows=results)
    else:
        outcome = _RankOutcome(checksums, write_results=results)
    if reuse_metadata_obj is None:
        return outcome, None
    mismatch = find_layout_mismatch(outcome.decoded(), reuse_metadata_obj)
    if mismatch is not None:
        return None, _stale_error(rank, mismatch)
    return _RankOutcome(checksums), None  # the prepared metadata already locates them


def _returned_failure(wrapped: tuple[BaseException, Any]) -> Exception:
    """The exception of a returned ``(exception, stack summary)`` pair, with the stack as
    its remote traceback when it carries none of its own."""
    exc, stack = wrapped
    if not isinstance(exc, Exception):
        exc = CheckpointingException(f"{type(exc).__name__}: {exc}")
    if exc.__traceback__ is None and exc.__cause__ is None:
        exc.__cause__ = RemoteTraceback("".join(stack.format()))
    return exc


_find_layout_mismatch = find_layout_mismatch  # NVRx's name


def _compact_results(writer: Any) -> Any:
    """The writer's encoded results (``retrieve_write_rows``) when its write results are
    ours as they are; None when a subclass or the caller replaced ``retrieve_write_results``
    (NVRx's tests stub it), whose results then travel as they come."""
    ours = FileSystemWriterAsync.retrieve_write_results
    if getattr(type(writer), "retrieve_write_results", None) is not ours:
        return None
    if "retrieve_write_results" in vars(writer):
        return None
    return writer.retrieve_write_rows


def _commit(writer: Any, global_metadata: PlannedMetadata, outcomes: list[_RankOutcome]) -> None:
    metadata = planned_metadata(global_metadata)
    if metadata is None:
        raise InvalidRequestError(
            "the coordinator has no global metadata to commit: pass the result of "
            "save_state_dict_async_plan to save_state_dict_async_finalize unchanged"
        )
    results = [outcome.decoded() for outcome in outcomes]
    checksums: dict[str, tuple[int, int]] = {}
    for outcome in outcomes:
        checksums.update(outcome.file_checksums)
    if accepts(writer.finish, "file_checksums"):
        writer.finish(metadata, results, file_checksums=checksums)
    else:
        writer.finish(metadata, results)
