"""Planning an async DCP save, and the plan cache that lets a save of an unchanged structure
skip the planning's collectives.

**The steps.** :class:`Planning` runs the steps of ``torch.distributed.checkpoint.save``'s
planning in the same order (set up planner and writer, local plan, global plan on the
coordinator, finish), split so the saver (:mod:`.state_dict_saver`, which decides when the
cache is valid) can skip the collective part when its cache is valid, or plan without a
central step for planners that support it (Megatron's).

**Agreement.** Every collective of the planning is one of :mod:`.._dist`'s agreements, on
the library's gloo group (or the caller's sub-group: :func:`planning_ranks`), so none touches
CUDA and a rank that failed takes part in the same collective as the others, instead of
leaving them waiting in one it never joins. The saver's own small decisions (is the cached
plan valid everywhere, did some rank fail) are one ``all_gather`` of a few integers per rank
(:func:`.._dist.agree`); DCP's global plan is one gather of the local plans on the
coordinator and one scatter of each rank's part (:func:`.._dist.decide`). Any rank's failure,
or the coordinator's, raises ``RankFailureError`` (a torch ``CheckpointException`` too)
naming it on every rank.

**What a cached plan depends on.** A DCP save plan depends on the state's *structure*, never on
its values, and on who plans (planner type and settings, writer type, world size, rank,
coordinator: :meth:`Planning.context`). The structure is the key of :mod:`._structure` (keys,
containers, each leaf's type, each tensor's shape, dtype, ``requires_grad`` and layout, a
DTensor's spec, a ShardedTensor's shards and which of them this rank holds, the write items an
object with ``__create_write_items__`` makes). :func:`cached_plan` walks the state and compares
``(context, key)`` with the cache's; one small collective decides, the same on every rank,
whether every rank matched the same planning generation. Left out: ``pin_memory`` (querying
it may touch the CUDA driver) and values. A state the walk cannot describe is planned in full
at every save.

A hit sets the planner up without DCP's flattening where it can: a default planner's flat
state is rebuilt as ``dict(zip(fqns, leaves))`` (:class:`PlanRecord`), recorded only if DCP's
own flattening of the planned state visited exactly the walk's leaves (object by object).
Other planners run their own set-up.

**The cache.** :class:`CheckpointMetadataCache` holds what NVRx's class of that name holds,
under NVRx's attribute names (Megatron-LM reads and sets them; NVRx's methods over them are
in :mod:`._nvrx`), plus the record of the state it was planned for, under its key. It only
keeps them; the saver decides when they are valid.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter
from torch.distributed.checkpoint.utils import _DistWrapper

from .. import _dist
from ..errors import CheckpointingException, ConfigurationError
from ._nvrx import MetadataCacheNames
from ._structure import Structure, StructureCache, walk

# -- what a plan depends on ------------------------------------------------------------------


def check_state_dict(state_dict: Any) -> None:
    """A DCP state dict is a mapping with string keys at the top level.

    Nested dicts may use other keys (optimizer states use ints): DCP flattens them with
    ``str()``. A top-level non-string key would be saved under a key that cannot be loaded
    back, or collide with its string form, so it is refused here with the offending key.
    """
    if not isinstance(state_dict, Mapping):
        raise ConfigurationError(
            f"state_dict must be a dict with string keys, got {type(state_dict).__name__}"
        )
    for key in state_dict:
        if not isinstance(key, str):
            raise ConfigurationError(
                f"state_dict key {key!r} is a {type(key).__name__}; torch.distributed."
                "checkpoint needs string keys at the top level (use str(key))"
            )


def planner_settings(planner: Any) -> list[tuple[str, Any]]:
    """The planner's scalar attributes (its flags), sorted: part of what a plan depends on."""
    scalars = (bool, int, float, str, type(None))
    return sorted((k, v) for k, v in vars(planner).items() if isinstance(v, scalars))


# -- the steady-state record -----------------------------------------------------------------------


def planner_supported(planner: Any) -> bool:
    """A planner whose set-up is DCP's flattening, so the fast path may emulate it."""
    return (
        isinstance(planner, DefaultSavePlanner)
        and type(planner).set_up_planner is DefaultSavePlanner.set_up_planner
        and bool(getattr(planner, "flatten_state_dict", False))
        and not getattr(planner, "_enable_plan_caching", False)
    )


@dataclass(frozen=True)
class PlanRecord:
    """What the cache keeps under the structure key of the state it planned for:
    ``generation`` (the planning it came from) and, where DCP's flattening of that state
    visited exactly the walk's leaves, how to rebuild the planner's flat state without it
    (``fqns``, None otherwise)."""

    generation: int
    fqns: tuple[str, ...] | None = None
    mappings: dict | None = None

    @classmethod
    def of(cls, planning: Planning, structure: Structure, generation: int) -> PlanRecord:
        """After a full planning of ``structure``'s state."""
        planner = planning.planner
        flat = getattr(planner, "state_dict", None)
        if (
            not planner_supported(planner)
            or is_decentralized(planner, planning.writer)
            or not isinstance(flat, dict)
            or len(flat) != len(structure.leaves)
            or any(a is not b for a, b in zip(flat.values(), structure.leaves, strict=True))
        ):
            return cls(generation)
        mappings = dict(getattr(planner, "mappings", {}) or {})
        return cls(generation, tuple(flat), mappings)

    def set_up(self, planning: Planning, leaves: list) -> None:
        """What ``DefaultSavePlanner.set_up_planner`` would leave for a state with the
        recorded structure, without flattening (only with ``fqns``)."""
        planner: Any = planning.planner
        planner.state_dict = dict(zip(cast(tuple, self.fqns), leaves, strict=True))
        planner.mappings = dict(self.mappings or {})
        planner.is_coordinator = planning.dist_wrapper.is_coordinator
        planning.is_set_up = True


# -- the plan cache --------------------------------------------------------------------------------


class CheckpointMetadataCache(MetadataCacheNames):
    """Plans and global metadata of the last full planning, reused while valid.

    Attributes (NVRx names): ``cached_central_plan`` (this rank's final plan),
    ``cached_local_plan``, ``cached_global_metadata`` (coordinator only),
    ``validated_cache_reuse`` (the last save reused the cached plan),
    ``validated_loaded_metadata_reuse`` (the last decentralized save reused metadata loaded
    from a previous checkpoint), ``loaded_all_plans`` (from that metadata). Ours:
    ``structures`` (the record of the state the cache was built for, under its structure
    key), ``hits``, ``misses``. NVRx's methods over them: :class:`._nvrx.MetadataCacheNames`.
    """

    def __init__(self) -> None:
        self.cached_central_plan: SavePlan | None = None
        self.cached_local_plan: SavePlan | None = None
        self.cached_global_metadata: Metadata | None = None
        self.validated_cache_reuse = False
        self.validated_loaded_metadata_reuse = False
        self.loaded_all_plans: list[SavePlan] | None = None
        # The record of the state the cached plan was made for, under its structure key.
        self.structures: StructureCache[PlanRecord] = StructureCache()
        self.hits = 0
        self.misses = 0

    def remember(
        self,
        key: tuple | None,
        tensors: Sequence[torch.Tensor],
        record: PlanRecord | None,
        central_plan: SavePlan,
        local_plan: SavePlan | None,
        global_metadata: Metadata | None,
    ) -> None:
        """Replace the cache by the result of a full planning (of a state whose structure
        has ``key`` and plain tensors ``tensors``; None: a state the walk cannot describe,
        never reused)."""
        self.structures.clear()
        if key is not None and record is not None:
            self.structures.remember(key, tensors, record)
        self.cached_central_plan = central_plan
        self.cached_local_plan = local_plan
        if global_metadata is not None:
            self.cached_global_metadata = global_metadata
        self.validated_cache_reuse = False
        self.misses += 1


# -- the planning steps and their agreement --------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _parameter_names(function: Callable) -> frozenset[str]:
    return frozenset(inspect.signature(function).parameters)


def accepts(method: Callable, name: str) -> bool:
    """Whether ``method`` has a parameter called ``name`` (planners and writers of other
    torch versions or subclasses differ). Answered once per function, not per save: the
    steady-state save asks twice."""
    try:
        return name in _parameter_names(getattr(method, "__func__", method))
    except TypeError:  # an unhashable callable object: ask every time
        return name in inspect.signature(method).parameters


def agreement_group(dist_wrapper: _DistWrapper) -> Any:
    """The planning ranks' group for :func:`resilient_ckpt._dist.agree`: None (the
    library's gloo group) when planning spans the default group."""
    group = dist_wrapper.group
    return None if group is None or group == dist.group.WORLD else group


def planning_ranks(dist_wrapper: _DistWrapper) -> dict[str, Any]:
    """Where the planning ranks agree, as keyword arguments of :func:`.._dist.agree` and
    :func:`.._dist.decide`: their group, and whether this rank plans alone."""
    alone = not dist_wrapper.use_dist or dist_wrapper.get_world_size() == 1
    return {"group": agreement_group(dist_wrapper), "local_only": alone}


def plan_matches_loaded(
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
    on gloo; only when the loaded plans cover every rank). NVRx's name, exported by
    :mod:`.state_dict_saver`."""
    if not loaded_all_plans or len(loaded_all_plans) != dist_wrapper.get_world_size():
        return False
    ok = plan_matches_loaded(loaded_all_plans, local_plan, rank, dist_wrapper.get_world_size())
    outcomes = _dist.agree(
        "verify_global_md_reuse", None, ints=(int(ok),), **planning_ranks(dist_wrapper)
    )
    return all(o.ints[0] for o in outcomes)


def check_writer(storage_writer: Any) -> None:
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


class Planning:
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
        if accepts(self.planner.set_up_planner, "storage_meta"):
            self.planner.set_up_planner(
                self.state_dict,
                storage_meta=self.writer.storage_meta(),
                is_coordinator=coordinator,
            )
        else:
            self.planner.set_up_planner(self.state_dict, is_coordinator=coordinator)
        self.set_up_writer()
        self.is_set_up = True

    def set_up_writer(self) -> None:
        coordinator = self.dist_wrapper.is_coordinator
        if accepts(self.writer.set_up_storage_writer, "kwargs"):
            self.writer.set_up_storage_writer(
                coordinator, rank=self.dist_wrapper.rank, use_collectives=True
            )
        else:
            self.writer.set_up_storage_writer(coordinator)

    def context(self) -> tuple:
        """Who plans: planner type and settings, writer type, world size, ranks (None for
        every rank of the default group, whichever group object carries the collectives:
        a deferred plan runs them on the library's background group)."""
        group = self.dist_wrapper.group
        ranks = None if group is None else tuple(dist.get_process_group_ranks(group))
        if ranks is not None and ranks == tuple(range(dist.get_world_size())):
            ranks = None
        return (
            f"{type(self.planner).__module__}.{type(self.planner).__qualname__}",
            # is_coordinator: set by set_up_planner; the coordinator rank is below anyway.
            [kv for kv in planner_settings(self.planner) if kv[0] != "is_coordinator"],
            f"{type(self.writer).__module__}.{type(self.writer).__qualname__}",
            self.dist_wrapper.get_world_size(),
            self.dist_wrapper.rank,
            self.dist_wrapper.coordinator_rank,
            ranks,
        )

    def local_step(self) -> SavePlan:
        """This rank's plan (its inputs checked first: a bad state dict or writer is a
        failure of this step, which the planning's agreement carries to every rank)."""
        check_state_dict(self.state_dict)
        check_writer(self.writer)
        if not self.is_set_up:
            self.set_up()
        plan = self.planner.create_local_plan()
        self.local_plan = self.writer.prepare_local_plan(plan)
        return self.local_plan

    def global_step(self, all_local_plans: list[SavePlan]) -> list[SavePlan]:
        all_local_plans, self.global_metadata = self.planner.create_global_plan(all_local_plans)
        share_equal_sizes(self.global_metadata)
        return self.writer.prepare_global_plan(all_local_plans)

    def plan_centrally(self) -> SavePlan:
        """DCP's planning as one agreement: every rank's local plan to the coordinator, which
        makes the global plan; each rank gets its own part. A failure of any rank's local
        step, or of the coordinator's global step, raises on every rank."""
        dw = self.dist_wrapper
        local_plan, error = _local_attempt(self)
        return _dist.decide(
            "DCP save planning",
            error,
            local_plan,
            self.global_step,
            coordinator=dw.coordinator_rank,
            scatter=True,
            **planning_ranks(dw),
        )

    def plan_decentralized(
        self, loaded: list[SavePlan] | None, loaded_metadata: Metadata | None
    ) -> tuple[SavePlan, bool]:
        """Local plans are gathered only to build the metadata (not at all when the metadata
        loaded from the previous checkpoint still fits); each rank finishes its own plan."""
        dw = self.dist_wrapper
        matches = False
        local_plan, error = _local_attempt(self)
        if local_plan is not None:
            matches = plan_matches_loaded(loaded, local_plan, dw.rank, dw.get_world_size())
        outcomes = _dist.agree(
            "DCP save planning (decentralized plan)",
            error,
            ints=(int(matches),),
            **planning_ranks(dw),
        )
        reuse_loaded = all(o.ints[0] for o in outcomes) and bool(loaded)
        local_plan = cast(SavePlan, local_plan)  # set: the agreement raised otherwise
        if reuse_loaded and dw.is_coordinator:
            self.global_metadata = loaded_metadata
        elif not reuse_loaded:
            _dist.decide(
                "DCP save planning (global metadata)",
                None,
                local_plan,
                self._metadata_of,
                coordinator=dw.coordinator_rank,
                **planning_ranks(dw),
            )
        plan = self.planner.create_decentralized_global_plan(local_plan)  # type: ignore[attr-defined]
        return self.writer.prepare_decentralized_global_plan(plan), reuse_loaded

    def _metadata_of(self, all_local_plans: list[SavePlan]) -> None:
        """The coordinator's metadata of a decentralized save, from every rank's local plan."""
        _, metadata = self.planner.create_global_plan(all_local_plans)
        share_equal_sizes(metadata)
        metadata.all_local_plans = all_local_plans  # type: ignore[attr-defined]
        self.global_metadata = metadata


def share_equal_sizes(metadata: Metadata) -> None:
    """Make equal ``torch.Size`` values of ``metadata``'s entries one object each (they are
    immutable): pickle writes an object met again as a reference, so the commit record of a
    state whose shapes repeat (a model's layers) is pickled at each save in a fraction of the
    time. Once per plan; a value that is not a ``torch.Size`` is left as it is."""
    shared: dict[tuple, torch.Size] = {}

    def one(size: Any) -> Any:
        return shared.setdefault(tuple(size), size) if type(size) is torch.Size else size

    for entry in metadata.state_dict_metadata.values():
        if isinstance(entry, TensorStorageMetadata):
            entry.size = one(entry.size)
            for chunk in entry.chunks:
                chunk.offsets, chunk.sizes = one(chunk.offsets), one(chunk.sizes)


def _local_attempt(planning: Planning) -> tuple[SavePlan | None, Exception | None]:
    """This rank's local plan, or the exception that keeps it from one."""
    try:
        return planning.local_step(), None
    except Exception as exc:
        return None, exc


def is_decentralized(planner: Any, writer: Any) -> bool:
    return bool(getattr(planner, "can_run_decentralized_global_plan", False)) and bool(
        getattr(writer, "can_run_decentralized_global_plan", False)
    )


# -- the steady-state check ------------------------------------------------------------------------


def structure_key(planning: Planning) -> tuple[Structure | None, tuple | None]:
    """This save's structure and its cache key ``(context, structure key)``, taken once and
    before any set-up (a planner's own set-up may set attributes the context reads);
    ``(None, None)`` for a state the walk cannot describe."""
    structure = walk(planning.state_dict)
    if structure is None:
        return None, None
    return structure, (planning.context(), structure.key)


def cached_plan(
    planning: Planning,
    cache: CheckpointMetadataCache,
    prepare: Callable[[SavePlan], SavePlan],
) -> tuple[SavePlan | None, Structure | None, tuple | None]:
    """The cached central plan, finished and prepared by ``prepare`` (the writer's data for
    this save), if every rank's state has the structure its cached plan was made for, in the
    same planning generation (else None); and this save's structure and key
    (:func:`structure_key`).

    Collective (one small all-gather on a gloo group): it also carries every failure of this
    rank's part, from a bad writer to a value that cannot be pickled while the write is
    prepared, so any rank's failure raises on every rank in this one agreement. A rank whose
    record matched prepares before the agreement; when another rank's did not, the
    preparation is redone after the full planning.
    """
    structure: Structure | None = None
    key: tuple | None = None
    record: PlanRecord | None = None
    prepared: SavePlan | None = None
    error: Exception | None = None
    try:
        check_writer(planning.writer)
        structure, key = structure_key(planning)
        record = cache.structures.lookup(key, structure.tensors if structure else ())
        if record is not None and record.fqns is None:
            planning.set_up()  # the planner's own set-up, for one that needs it
        elif record is not None and structure is not None:
            planning.set_up_writer()
            record.set_up(planning, structure.leaves)
        if record is not None and cache.cached_central_plan is not None:
            prepared = prepare(cache.cached_central_plan)
    except Exception as exc:
        error = exc
    outcomes = _dist.agree(
        "DCP save planning (plan cache check)",
        error,
        ints=(record is not None, record.generation if record is not None else -1),
        **planning_ranks(planning.dist_wrapper),
    )
    if not all(o.ints[0] for o in outcomes) or len({o.ints[1] for o in outcomes}) != 1:
        if record is not None and record.fqns is not None:
            planning.is_set_up = False  # the full planning sets the planner up its own way
        return None, structure, key
    if prepared is None:  # this rank reported a match above
        raise CheckpointingException("planning: a matched plan record went missing")
    return prepared, structure, key
