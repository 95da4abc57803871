"""Names that exist only for code written against NVRx, and who reaches for them.

The async DCP flow keeps NVRx's public names at NVRx's module paths (DESIGN.md section 1).
Most of them are the flow itself (``FileSystemWriterAsync.prepare_write_data``,
``save_state_dict_async_plan``, ...). The ones here are not: no save calls them, they stand
where NVRx's callers look. Keeping them in one module keeps the writer and the plan cache to
what a save uses, and shows in one place what the compatibility costs.

* :class:`WriterNames`, a base of ``filesystem_async.FileSystemWriterAsync``:

  - ``_cached_identifiers``, ``_cached_tensor_data_ptrs``, ``_shm_tensor_cache``: NVRx's
    class-level caches of its CUDA IPC and shared-memory staging. Upstream's own tests
    (``test_async_writer.py``) ``.clear()`` them between cases. Our staging keeps no
    per-class state (its shared-memory arenas belong to each queue's caller), so they stay
    empty unless a caller puts something in them.
  - ``cleanup_tensor_caches()``: NVRx's classmethod that clears the three.
  - ``is_multi_proc_io``: NVRx's attribute name for the constructor's ``is_multiproc_io``.
  - ``results_queue``: NVRx's per-writer handle on the results queue; always None here, our
    write reports come back over the worker's channel (:mod:`._reports`).

* :class:`WriteResultsQueue`, what ``filesystem_async.get_write_results_queue(mp_mode=)``
  returns and keeps in the module global ``filesystem_async._results_queue``. NVRx passes that
  queue to its writer processes; Megatron-LM (``megatron/training/async_utils.py``) calls
  ``get_write_results_queue(mp_mode="fork")`` when it warms the persistent worker up, probes
  the module for ``_results_queue`` (``strategies/nvrx.py``) and calls
  ``_results_queue._manager.shutdown()`` when it resets the worker. Nothing puts into or
  gets from it, here or there, so it is a plain in-process queue, made on the first call; a
  ``multiprocessing`` manager (NVRx's) would start a server process per trainer for nothing.
  The function and the global stay in ``filesystem_async``: Megatron reads the global there,
  and a function here could only set it through a module ``__getattr__``.

* :class:`MetadataCacheNames`, a base of ``state_dict_saver.CheckpointMetadataCache``:
  NVRx's methods over the cache's NVRx attributes. ``set_cached_global_metadata``
  (Megatron's ``TorchDistSaveShardedStrategy`` seeds the cache with a loaded checkpoint's
  metadata, whose ``all_local_plans`` a decentralized planning may reuse;
  ``init_checkpoint_metadata_cache`` does the same) and
  ``get_metadata_caching_status`` (``state_dict_saver.get_metadata_caching_status``);
  ``set_cache_metadata``, ``prepare_save_state_dict_ret`` and ``get_cache_metadata`` are the
  steps NVRx's own ``save_state_dict_async_plan`` runs on the cache, kept for code that drives
  a cache by hand. Our saver updates the cache itself (``CheckpointMetadataCache.remember``).

Left at their public modules, because moving them here would make this module import the
one that imports it: ``filesystem_async._wrap_exception`` (NVRx's test replaces the module
global, and the finalize reads it there at each call), ``state_dict_saver._find_layout_mismatch``
(an alias of the finalize's own check) and ``verify_global_md_reuse`` (built from the
planning's agreement, :mod:`._planning`).

This module imports nothing of the async core, so any module of it may import this one.
"""

from __future__ import annotations

import multiprocessing
import queue
from typing import TYPE_CHECKING, Any, ClassVar

from .._logging import get_logger

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import SavePlan

logger = get_logger(__name__)


class WriterNames:
    """NVRx's names on ``FileSystemWriterAsync`` that our writer does not use (module note)."""

    is_multiproc_io: bool
    results_queue: Any = None

    _cached_identifiers: ClassVar[set[str]] = set()
    _cached_tensor_data_ptrs: ClassVar[dict[str, tuple]] = {}
    _shm_tensor_cache: ClassVar[dict[str, tuple[list, list]]] = {}

    @property
    def is_multi_proc_io(self) -> bool:
        """NVRx's attribute name for ``is_multiproc_io``."""
        return self.is_multiproc_io

    @classmethod
    def cleanup_tensor_caches(cls) -> None:
        """Clear NVRx's class-level staging caches (empty here; see the module note)."""
        cls._cached_identifiers.clear()
        cls._cached_tensor_data_ptrs.clear()
        cls._shm_tensor_cache.clear()


class _NoManager:
    """Stands where NVRx's queue proxy has its ``multiprocessing`` manager: there is no
    server process to stop."""

    def shutdown(self) -> None:
        """Nothing to do (Megatron-LM calls it when it resets the persistent worker)."""


class WriteResultsQueue(queue.Queue[Any]):
    """The queue ``get_write_results_queue`` hands out: an in-process ``queue.Queue`` with
    NVRx's ``_manager`` attribute (module note). ``mp_mode`` is checked as NVRx checks it
    (``multiprocessing.get_context``: an unknown one raises ``ValueError``) and not used.
    """

    def __init__(self, mp_mode: str = "spawn") -> None:
        multiprocessing.get_context(mp_mode)
        super().__init__()
        self._manager = _NoManager()


class MetadataCacheNames:
    """NVRx's methods of ``CheckpointMetadataCache`` that our saver does not call (module
    note). The attributes are the cache's own."""

    cached_central_plan: SavePlan | None
    cached_local_plan: SavePlan | None
    cached_global_metadata: Metadata | None
    validated_cache_reuse: bool
    validated_loaded_metadata_reuse: bool
    loaded_all_plans: list[SavePlan] | None

    def set_cached_global_metadata(self, cached_global_metadata: Metadata | None) -> None:
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
