"""The sharded state both Megatron tests save: Megatron's own types, imported in the ranks."""

from __future__ import annotations

import argparse
import importlib.util
from typing import Any

import pytest
import torch

# The marks of both Megatron test modules: multi-process, bounded, megatron-core installed.
MEGATRON_MARKS = [
    pytest.mark.dist,
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        importlib.util.find_spec("megatron") is None,
        reason="megatron-core is not installed (make venv installs the 'megatron' extra)",
    ),
]


def full_tensors() -> dict[str, torch.Tensor]:
    """The global tensors, identical on every rank (same seed)."""
    g = torch.Generator().manual_seed(20261123)
    return {
        "decoder.weight": torch.randn(8, 6, generator=g),
        "decoder.bias": torch.randn(4, 10, generator=g).to(torch.bfloat16),
        "counts": torch.randint(-(2**40), 2**40, (6,), generator=g),
        "norm": torch.randn(3, 3, generator=g, dtype=torch.float64),
    }


def sharded_state(rank: int, world: int, full: dict[str, torch.Tensor]) -> dict[str, Any]:
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    def shard(key: str, axis: int) -> ShardedTensor:
        local = full[key].chunk(world, axis)[rank].contiguous().clone()
        return ShardedTensor.from_rank_offsets(key, local, (axis, rank, world))

    return {
        "decoder": {"weight": shard("decoder.weight", 0), "bias": shard("decoder.bias", 1)},
        "counts": shard("counts", 0),
        # replicated on every rank; Megatron saves one main replica
        "norm": ShardedTensor.from_rank_offsets("norm", full["norm"].clone(), replica_id=rank),
        "rng": ShardedObject(
            "rng", {"rank": rank, "seed": 1000 + rank}, (world,), (rank,), replica_id=0
        ),
        # common (non-sharded) state, identical on every rank; Megatron keeps its args here
        "iteration": 7,
        "args": argparse.Namespace(async_save=True, async_strategy="nvrx"),
    }


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def check_loaded(loaded: dict[str, Any], rank: int, world: int, full: dict[str, Any]) -> None:
    expect = {
        "decoder.weight": full["decoder.weight"].chunk(world, 0)[rank],
        "decoder.bias": full["decoder.bias"].chunk(world, 1)[rank],
        "counts": full["counts"].chunk(world, 0)[rank],
        "norm": full["norm"],
    }
    got = {
        "decoder.weight": loaded["decoder"]["weight"],
        "decoder.bias": loaded["decoder"]["bias"],
        "counts": loaded["counts"],
        "norm": loaded["norm"],
    }
    for key, tensor in expect.items():
        assert _bit_equal(got[key], tensor), f"rank {rank}: {key} differs after load"
    assert loaded["rng"] == {"rank": rank, "seed": 1000 + rank}
    assert loaded["iteration"] == 7 and loaded["args"].async_strategy == "nvrx"


def local_tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors behind the state's shards (the "model"; Megatron may drop its references)."""
    shards = (state["decoder"]["weight"], state["decoder"]["bias"], state["counts"], state["norm"])
    return [shard.data for shard in shards]


def change_in_place(tensors: list[torch.Tensor]) -> None:
    """What a training step does to the saved tensors (a checkpoint must not see it)."""
    for tensor in tensors:
        tensor.mul_(-3)


def load_template(rank: int, world: int, full: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The sharded state to load into: same keys and shards, zero data, no common part."""
    state = sharded_state(rank, world, {k: torch.zeros_like(v) for k, v in full.items()})
    del state["iteration"], state["args"]  # common state comes from the checkpoint
    return state
