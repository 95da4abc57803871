"""The planning half of an async DCP save: torch's steps, plus agreement on a CPU group.

:class:`Planning` runs the steps of ``torch.distributed.checkpoint.save``'s planning in the
same order (set up planner and writer, local plan, global plan on the coordinator, finish),
split so the saver can skip the collective part when its cache is valid, or plan without a
central step for planners that support it (Megatron's).

Agreement: the saver's own small decisions (is the cached plan valid everywhere, did some
rank fail to set up) are one ``all_gather`` of two integers per rank, on the library's gloo
group (or the caller's group if it is gloo-capable), so they never touch CUDA and cost one
round trip. If the caller's group has no CPU backend, object collectives on it are used.
A rank that failed contributes a flag; every rank then raises ``RankFailureError`` (a
torch ``CheckpointException`` too) naming it, instead of some ranks waiting in a
collective the failed rank never joins. The agreement itself is :func:`.._dist.agree`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any, cast

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter
from torch.distributed.checkpoint.utils import _DistWrapper

from .. import _dist
from ..errors import ConfigurationError
from ._structure import planner_settings, structure_signature


@functools.lru_cache(maxsize=64)
def _parameter_names(function: Callable) -> frozenset[str]:
    return frozenset(inspect.signature(function).parameters)


def accepts(method: Callable, name: str) -> bool:
    """Whether ``method`` has a parameter called ``name`` (planners and writers of other
    torch versions or subclasses differ). Answered once per function, not per save:
    ``inspect.signature`` costs ~0.1 ms, twice in every steady-state save."""
    try:
        return name in _parameter_names(getattr(method, "__func__", method))
    except TypeError:  # an unhashable callable object: ask every time
        return name in inspect.signature(method).parameters


def agreement_group(dist_wrapper: _DistWrapper) -> Any:
    """The planning ranks' group for :func:`resilient_ckpt._dist.agree`: None (the
    library's gloo group) when planning spans the default group."""
    group = dist_wrapper.group
    return None if group is None or group == dist.group.WORLD else group


def agree(ok: bool, error: BaseException | None, dist_wrapper: _DistWrapper, step: str) -> bool:
    """True iff ``ok`` on every planning rank; on any rank's ``error``, raise on every rank.

    One tensor all-gather on a gloo group (an object all-gather if the caller's group has
    no CPU backend); raises :class:`~resilient_ckpt.errors.RankFailureError` (a torch
    ``CheckpointException`` too) naming the failed ranks.
    """
    outcomes = _dist.agree(
        step,
        error,
        ints=(int(ok),),
        group=agreement_group(dist_wrapper),
        local_only=not dist_wrapper.use_dist or dist_wrapper.get_world_size() == 1,
    )
    return all(o.ints[0] for o in outcomes)


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
    return agree(ok, None, dist_wrapper, "verify_global_md_reuse")


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

    def signature(self) -> bytes:
        flat = getattr(self.planner, "state_dict", None)
        if not isinstance(flat, Mapping):
            flat = _flattened(self.state_dict)
        return structure_signature(flat, self.context())

    def local_step(self) -> SavePlan:
        if not self.is_set_up:
            self.set_up()
        plan = self.planner.create_local_plan()
        self.local_plan = self.writer.prepare_local_plan(plan)
        return self.local_plan

    def global_step(self, all_local_plans: list[SavePlan]) -> list[SavePlan]:
        all_local_plans, self.global_metadata = self.planner.create_global_plan(all_local_plans)
        return self.writer.prepare_global_plan(all_local_plans)

    def revalidate(self, cache: Any) -> tuple[bool, bytes | None]:
        """Set up, then agree with every rank whether the cached plan still fits."""
        signature: bytes | None = None
        matches, error = False, None
        try:
            self.set_up()
            signature = self.signature()
            matches = cache.matches(signature, self.dist_wrapper.is_coordinator)
        except Exception as exc:
            error = exc
        return agree(
            matches, error, self.dist_wrapper, "DCP save planning (plan cache check)"
        ), signature

    def plan_centrally(self) -> SavePlan:
        return self.dist_wrapper.reduce_scatter("plan", self.local_step, self.global_step)

    def plan_decentralized(
        self, loaded: list[SavePlan] | None, loaded_metadata: Metadata | None
    ) -> tuple[SavePlan, bool]:
        """Local plans are gathered only to build the metadata (not at all when the metadata
        loaded from the previous checkpoint still fits); each rank finishes its own plan."""
        dw = self.dist_wrapper
        matches, error = False, None
        try:
            mine = self.local_step()
            matches = plan_matches_loaded(loaded, mine, dw.rank, dw.get_world_size())
        except Exception as exc:
            error = exc
        reuse_loaded = agree(matches, error, dw, "DCP save planning (decentralized plan)") and bool(
            loaded
        )
        local_plan = cast(SavePlan, self.local_plan)  # set: agree() raised otherwise
        if reuse_loaded and dw.is_coordinator:
            self.global_metadata = loaded_metadata
        elif not reuse_loaded:
            all_local_plans = dw.gather_object(local_plan)
            if dw.is_coordinator and all_local_plans is not None:
                _, metadata = self.planner.create_global_plan(all_local_plans)
                metadata.all_local_plans = all_local_plans  # type: ignore[attr-defined]
                self.global_metadata = metadata
        plan = self.planner.create_decentralized_global_plan(local_plan)  # type: ignore[attr-defined]
        return self.writer.prepare_decentralized_global_plan(plan), reuse_loaded


def is_decentralized(planner: Any, writer: Any) -> bool:
    return bool(getattr(planner, "can_run_decentralized_global_plan", False)) and bool(
        getattr(writer, "can_run_decentralized_global_plan", False)
    )


def _flattened(state_dict: STATE_DICT_TYPE) -> Mapping[str, Any]:
    """``state_dict`` flattened to dotted keys as torch's default save planner flattens it
    (nested dicts and lists; sharded tensors left whole)."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    planner = DefaultSavePlanner(flatten_state_dict=True, flatten_sharded_tensors=False)
    planner.set_up_planner(state_dict, is_coordinator=False)
    return planner.state_dict
