"""Megatron-core, unchanged, saving through this package as its NVRx (2 gloo ranks, CPU).

The ranks start with ``RESILIENT_CKPT_NVRX_ALIAS=1`` in their environment, so the ``.pth``
start-up hook aliases ``nvidia_resiliency_ext.checkpointing`` before Megatron probes for it at
import (``strategies/torch.py`` sets ``HAVE_NVRX`` then). Megatron's own code does the rest:

* ``dist_checkpointing.save(..., async_sharded_save=True)`` with its default
  ``async_strategy="nvrx"``: it builds our ``FileSystemWriterAsync`` (``thread_count``,
  ``separation_hint``, ``use_msc``, ``use_cached_data_structure``), plans with our
  ``save_state_dict_async_plan`` (its own planner, ``enable_cache``, our
  ``CheckpointMetadataCache``) and returns our ``AsyncRequest``, finalized by our
  ``save_state_dict_async_finalize`` plus its ``metadata.json`` writer;
* the queue calls of ``megatron/training/async_utils.py`` (persistent worker warm-up,
  ``get_write_results_queue(mp_mode="fork")``, schedule, blocking finalize, close); that module
  itself cannot be imported on Python 3.11 (it uses ``typing.override``), so they are spelled
  out here;
* a second save with ``cached_metadata=True`` through ``FullyParallelSaveStrategyWrapper``
  (Megatron's default fully parallel save), which reuses the cached plan;
* ``dist_checkpointing.load`` with the plain strategy, and with the fully parallel load wrapper
  (``exchange_algo="gather_object"``) over ``cache_metadata=True``, which reads through our
  ``CachedMetadataFileSystemReader`` because the checkpoint's ``args`` say it was saved with
  ``async_strategy="nvrx"``.

Only CUDA calls are patched: the fully parallel load calls ``torch.cuda.synchronize()`` twice
after its exchange; it is replaced by a no-op in the ranks of that load (no CUDA device, and
nothing to synchronise on CPU). Everything is compared bit for bit, and the state is changed
in place right after the save is scheduled: the checkpoint must hold the values of the moment
of the save.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from resilient_ckpt.config import NVRX_ALIAS_ENV
from resilient_ckpt.testing.launcher import launch

from ._megatron_state import (
    MEGATRON_MARKS,
    change_in_place,
    check_loaded,
    full_tensors,
    load_template,
    local_tensors,
    sharded_state,
)

pytestmark = MEGATRON_MARKS


def _save_async(queue: Any, state: dict[str, Any], ckpt_dir: str, strategy: Any) -> None:
    from megatron.core import dist_checkpointing

    os.makedirs(ckpt_dir, exist_ok=True)
    tensors = local_tensors(state)
    request = dist_checkpointing.save(
        state, ckpt_dir, sharded_strategy=strategy, async_sharded_save=True
    )
    queue.schedule_async_request(request)
    change_in_place(tensors)  # the trainer goes on at once, before the write is done
    queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    assert queue.get_num_unfinalized_calls() == 0


def _megatron_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    import warnings

    warnings.filterwarnings("ignore")  # Megatron warns about missing TE/Apex on import
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )
    from megatron.core.dist_checkpointing.strategies.nvrx import is_nvrx_min_version
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue
    from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import (
        get_write_results_queue,
    )

    import resilient_ckpt

    # Megatron found "NVRx" at import, and it is this package.
    assert mcore_torch.HAVE_NVRX and is_nvrx_min_version()
    _, modules = mcore_torch.get_async_strategy("nvrx")
    assert modules["AsyncCallsQueue"] is resilient_ckpt.AsyncCallsQueue

    # megatron/training/async_utils.py: init_persistent_async_worker, then the save calls.
    queue = AsyncCallsQueue(persistent=True, cpu_shm_mode=False)
    AsyncCallsQueue.warmup_persistent_caller(rank, cpu_priority=10, io_priority=None)
    get_write_results_queue(mp_mode="fork")

    full = full_tensors()
    plain_dir = os.path.join(root, "iter_0000007")
    _save_async(queue, sharded_state(rank, world, full), plain_dir, None)

    # Megatron's default for training: fully parallel save with cached metadata, twice (the
    # second save reuses the cached plan).
    parallel = FullyParallelSaveStrategyWrapper(
        mcore_torch.TorchDistSaveShardedStrategy(cached_metadata=True),
        do_cache_distribution=True,
    )
    for step in (8, 9):
        _save_async(queue, sharded_state(rank, world, full), f"{root}/iter_{step:07d}", parallel)
    queue.close()
    return _load_all(rank, world, root, full)


def _load_all(rank: int, world: int, root: str, full: dict[str, Any]) -> dict[str, Any]:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
    )
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    for step in (7, 8, 9):
        template = load_template(rank, world, full)
        loaded = dist_checkpointing.load(template, f"{root}/iter_{step:07d}")
        check_loaded(loaded, rank, world, full)

    # The fully parallel load's only CUDA call is torch.cuda.synchronize(); see the docstring.
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    fp_load = FullyParallelLoadStrategyWrapper(
        TorchDistLoadShardedStrategy(cache_metadata=True), exchange_algo="gather_object"
    )
    for step in (8, 9):
        template = load_template(rank, world, full)
        loaded = dist_checkpointing.load(template, f"{root}/iter_{step:07d}", fp_load)
        check_loaded(loaded, rank, world, full)
    from resilient_ckpt.async_ckpt.cached_metadata_filesystem_reader import (
        CachedMetadataFileSystemReader,
    )

    cached = len(CachedMetadataFileSystemReader._metadata_cache)
    # megatron/training/async_utils.py: reset_persistent_async_worker's clean-up calls.
    from megatron.core.dist_checkpointing.strategies.torch import get_async_strategy
    from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async

    filesystem_async._results_queue._manager.shutdown()
    _, reader_cls = get_async_strategy("nvrx", "CachedMetadataFileSystemReader")
    reader_cls.clear_metadata_cache()
    assert not CachedMetadataFileSystemReader._metadata_cache
    return {"files": sorted(os.listdir(f"{root}/iter_0000009")), "cached_metadata": cached}


def test_megatron_async_sharded_save_and_load(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Set in the parent so every spawned rank (and its worker) starts with the alias.
    monkeypatch.setenv(NVRX_ALIAS_ENV, "1")
    results = launch(_megatron_rank, 2, str(tmp_path), timeout=200, start_method="spawn")
    assert all(r["cached_metadata"] >= 1 for r in results), results  # our reader was used
    files = results[0]["files"]
    assert "metadata.json" in files and ".metadata" in files
    assert sum(name.endswith(".distcp") for name in files) >= 2
