"""The plan cache of async DCP saves: the last full planning's plans and metadata.

Decision: one object per cache holds what NVRx's ``CheckpointMetadataCache`` holds, under
NVRx's attribute and method names (Megatron-LM reads and sets them), plus what our saver
needs to revalidate it every save: the structure signature of the state it was planned for
(:mod:`._structure`) and the steady-state record of that state (:mod:`._fast_plan`). The
saver (:mod:`.state_dict_saver`) decides when it is valid; this module only keeps it.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from .._logging import get_logger
from ._fast_plan import FastRecord

logger = get_logger(__name__)


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
        self.fast_record: FastRecord | None = None  # see ._fast_plan
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
        self.fast_record = None
        self.structure_signature = signature
        self.cached_central_plan = central_plan
        self.cached_local_plan = local_plan
        if global_metadata is not None:
            self.cached_global_metadata = global_metadata
        self.validated_cache_reuse = False
        self.misses += 1
