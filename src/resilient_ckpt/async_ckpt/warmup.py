"""The documented warm-up of the async DCP flow: the first save then costs a steady one.

A first save pays, besides its copy, for starting the worker, creating and pre-faulting the
staging arena, and the full collective planning. :func:`warmup_async_save` does all of it
ahead of time on every rank, without writing a checkpoint: it plans the state into a
throwaway writer (filling the plan cache and :mod:`._dcp_buckets`' per-plan cache), then
warms the queue for the bytes that plan stages. The next ``save_state_dict_async_plan`` of
the same structure, with the same ``metadata_cache`` and ``enable_cache=True``, reuses the
plan::

    queue = AsyncCallsQueue()
    warmup_async_save(state_dict, queue)           # collective, once
    ...
    writer = FileSystemWriterAsync(path)
    plan_ret = save_state_dict_async_plan(state_dict, writer, enable_cache=True)

``TorchAsyncCheckpoint`` and local checkpoints have no collective plan: their
``warmup(state_dict)`` does the equivalent.
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.planner import SavePlanner

from .core import AsyncCallsQueue
from .filesystem_async import FileSystemWriterAsync
from .state_dict_saver import CheckpointMetadataCache, save_state_dict_async_plan

__all__ = ["warmup_async_save"]


def warmup_async_save(
    state_dict: Any,
    queue: AsyncCallsQueue,
    *,
    process_group: dist.ProcessGroup | None = None,
    coordinator_rank: int = 0,
    planner: SavePlanner | None = None,
    metadata_cache: CheckpointMetadataCache | None = None,
    thread_count: int = 1,
    **writer_kwargs: Any,
) -> None:
    """Plan ``state_dict`` once and warm ``queue`` for its bytes (collective; see above).

    Pass the writer options (``thread_count``, ``single_file_per_rank``,
    ``separation_hint``...) your saves use, so the cached file split is theirs too.
    """
    scratch = tempfile.mkdtemp(prefix="resilient_ckpt_warmup_")
    try:
        writer = FileSystemWriterAsync(scratch, thread_count=thread_count, **writer_kwargs)
        save_state_dict_async_plan(
            state_dict,
            writer,
            process_group,
            coordinator_rank,
            planner,
            enable_cache=True,
            metadata_cache=metadata_cache,
        )
        save_fn, preload_fn, args = writer.get_save_function_and_args()
        queue.warmup((save_fn, args, None, preload_fn))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
