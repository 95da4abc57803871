"""Megatron-core's local checkpoints through this package as its NVRx (2 gloo ranks, CPU).

What ``megatron/training`` does for ``--non-persistent-ckpt-type local`` (that package cannot
be imported on Python 3.11, so its calls are spelled out): build a ``LocalCheckpointManager``
with ``CliqueReplicationStrategy.from_replication_params(jump, factor)``, wrap the sharded
state in Megatron's ``MCoreTensorAwareStateDict.from_state_dict(algo=...)`` (a subclass of our
``TensorAwareStateDict``, through the alias), ``save(..., is_async=True)`` on the NVRx queue,
then ``find_latest()``, ``load()`` and ``to_state_dict(...)``.

Both of Megatron's algorithms run: ``fully_parallel`` (each replicated shard saved by one rank,
exchanged again on load) and ``atomic``. CPU patch, only in the ranks: the fully parallel
exchange calls ``torch.cuda.synchronize()`` once; it is a no-op here, and the exchange uses
Megatron's ``exchange_algo="gather_object"`` (its default ``"broadcast"`` allocates with
``device="cuda"``). After the last save rank 1 loses its whole directory; a fresh manager
finds the iteration complete and loads rank 1's shard from the replica on rank 0.
"""

from __future__ import annotations

import os
import shutil
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


def _manager(root: str) -> Any:
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
        LocalCheckpointManager,
    )
    from nvidia_resiliency_ext.checkpointing.local.replication.strategies import (
        CliqueReplicationStrategy,
    )

    # replication_jump=1, replication_factor=2: ranks 0 and 1 hold each other's shard.
    return LocalCheckpointManager(
        root, repl_strategy=CliqueReplicationStrategy.from_replication_params(1, 2)
    )


def _save(manager: Any, queue: Any, state: dict[str, Any], iteration: int, algo: str) -> None:
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import (
        MCoreTensorAwareStateDict,
    )

    tensors = local_tensors(state)
    tasd, _ = MCoreTensorAwareStateDict.from_state_dict(state, algo=algo)
    request = manager.save(tasd, iteration, is_async=True)
    queue.schedule_async_request(request)
    change_in_place(tensors)  # training goes on before the write is done
    queue.maybe_finalize_async_calls(blocking=True, no_dist=False)


def _load(manager: Any, rank: int, world: int, full: dict[str, Any], algo: str) -> tuple:
    tasd, ckpt_id = manager.load()
    exchange = {"exchange_algo": "gather_object"} if algo == "fully_parallel" else {}
    loaded = tasd.to_state_dict(load_template(rank, world, full), algo=algo, **exchange)
    check_loaded(loaded, rank, world, full)
    return ckpt_id


def _local_rank(rank: int, world: int, root: str) -> list[Any]:
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")  # Megatron warns about missing TE/Apex on import
    from megatron.core.dist_checkpointing import tensor_aware_state_dict as mcore_tasd
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue

    from resilient_ckpt.local.base_state_dict import TensorAwareStateDict

    assert mcore_tasd.HAVE_NVRX
    assert issubclass(mcore_tasd.MCoreTensorAwareStateDict, TensorAwareStateDict)
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]

    full = full_tensors()
    manager, queue = _manager(root), AsyncCallsQueue(persistent=True)
    ids = []
    _save(manager, queue, sharded_state(rank, world, full), 10, "fully_parallel")
    assert manager.find_latest() == 10
    ids.append(_load(manager, rank, world, full, "fully_parallel"))
    _save(manager, queue, sharded_state(rank, world, full), 20, "atomic")
    queue.close()

    dist.barrier()
    if rank == 1:
        shutil.rmtree(os.path.join(root, "1"))
    dist.barrier()
    restarted = _manager(root)
    assert restarted.find_latest() == 20
    ids.append(_load(restarted, rank, world, full, "atomic"))
    return ids


def test_megatron_local_checkpoints_with_replication(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(NVRX_ALIAS_ENV, "1")
    results = launch(_local_rank, 2, str(tmp_path), timeout=200, start_method="spawn")
    assert results == [[(10, 0, ""), (20, 0, "")], [(10, 1, ""), (20, 1, "")]]
    # retention kept the newest iteration only; rank 0 holds both shards of it
    kept = os.listdir(tmp_path / "0")
    assert all("0000020" in name for name in kept), kept
    assert {"iter_0000020_0_local.pt", "iter_0000020_1_local.pt"} <= set(kept)
