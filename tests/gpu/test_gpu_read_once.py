"""Read-once loads into CUDA tensors under an NCCL default group: tensor items travel device to
device over NCCL (the library's gloo group still carries the agreement and bytes items), the
result is torch's reader's bit for bit, and the checkpoint is read once. Needs two GPUs or
more (NCCL takes one device per rank)."""

from __future__ import annotations

import os
import warnings
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from resilient_ckpt.testing import launch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.dist,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs two CUDA devices (one per NCCL rank)",
    ),
]


def _state(device: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    state: dict[str, Any] = {f"w{k}": torch.randn(256 + k, 33, generator=g) for k in range(6)}
    state["bf16"] = torch.randn(999, generator=g).to(torch.bfloat16)
    state["flag"] = torch.tensor([True, False, True])  # odd sizes: items need aligning
    state = {k: v.to(device) for k, v in state.items()}
    state["step"] = 12  # a bytes item: over gloo
    return state


def _blank(state: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if torch.is_tensor(v) else None for k, v in state.items()}


def _exact(a: dict[str, Any], b: dict[str, Any]) -> bool:
    for key in a:
        x, y = a[key], b[key]
        if torch.is_tensor(x):
            if x.device != y.device or x.dtype != y.dtype or not torch.equal(x.cpu(), y.cpu()):
                return False
        elif x != y:
            return False
    return a.keys() == b.keys()


def _load_on_gpus(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from resilient_ckpt.async_ckpt.cached_metadata_filesystem_reader import (
        CachedMetadataFileSystemReader,
        bytes_read_by_rank,
    )

    warnings.filterwarnings("ignore")
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"file://{os.path.join(root, 'store')}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    devices: list[str] = []
    original = dist.batch_isend_irecv

    def recording(ops: list[Any]) -> Any:
        devices.extend(op.tensor.device.type for op in ops)
        return original(ops)

    try:
        path = os.path.join(root, "ck")
        state = _state("cuda")
        dcp.save(state, checkpoint_id=path)
        theirs = _blank(state)
        dcp.load(theirs, storage_reader=dcp.FileSystemReader(path))
        dist.batch_isend_irecv = recording
        ours = _blank(state)
        reader = CachedMetadataFileSystemReader(path)
        dcp.load(ours, storage_reader=reader)
        dist.batch_isend_irecv = original
        names = [n for n in os.listdir(path) if n.endswith(".distcp")]
        stored = sum(os.path.getsize(os.path.join(path, n)) for n in names)
        return {
            "exact": _exact(ours, theirs) and _exact(ours, state),
            "devices": sorted(set(devices)),
            "read": sum(bytes_read_by_rank(reader)),
            "stored": stored,
        }
    finally:
        dist.batch_isend_irecv = original
        dist.destroy_process_group()


def test_cuda_destinations_take_nccl_and_read_once(tmp_path) -> None:
    world = min(torch.cuda.device_count(), 4)
    results = launch(_load_on_gpus, world, str(tmp_path), timeout=280, process_group=False)
    for facts in results:
        assert facts["exact"], facts
        assert "cuda" in facts["devices"], facts  # tensor items went device to device
        assert facts["read"] <= 1.1 * facts["stored"], facts
