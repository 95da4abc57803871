"""A retrieved shard travels in chunks, is checksummed as they arrive, and can land in a
buffer reserved before the transfer (2 gloo ranks)."""

from __future__ import annotations

import zlib

import pytest
import torch

from resilient_ckpt.testing import launch

pytestmark = pytest.mark.dist


def _transfer(rank: int, world_size: int, size: int) -> dict:
    from resilient_ckpt.local.replication import _chunked
    from resilient_ckpt.local.replication.group_utils import CliqueGroup, ExchangePlan

    _chunked.CHUNK_BYTES = 64 << 10  # many chunks, and a short last one
    group = CliqueGroup(None)
    plan = ExchangePlan(group)
    plan.plan(sender=0, receiver=1, id_="shard-of-1")
    plan.plan(sender=0, receiver=0, id_="shard-of-0")
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator())
    mine = {"shard-of-1": (data, 0), "shard-of-0": (data[:10], 0)} if rank == 0 else {}
    reserved = None
    if rank == 1:
        _chunked.reserve(size)
        reserved = _chunked._reserved[size].data_ptr()
    result = group.execute_plan(plan, mine)
    out: dict = {"ids": sorted(result)}
    if rank == 1:
        buf, kind, crc = result["shard-of-1"]
        out.update(
            same=torch.equal(buf, data),
            crc_ok=crc == zlib.crc32(bytes(data.numpy())),
            kind=kind,
            used_reserved=buf.data_ptr() == reserved,
            left=len(_chunked._reserved),
        )
    else:
        out["own_crc"] = result["shard-of-0"][2]
    return out


@pytest.mark.timeout(120)
def test_chunked_transfer_checksums_on_arrival_into_the_reserved_buffer():
    size = (64 << 10) * 3 + 123
    r0, r1 = launch(_transfer, 2, size, timeout=90)
    assert r0 == {"ids": ["shard-of-0"], "own_crc": None}
    assert r1 == {
        "ids": ["shard-of-1"],
        "same": True,
        "crc_ok": True,
        "kind": 0,
        "used_reserved": True,
        "left": 0,
    }
