"""Read-once loads on 4 gloo ranks: the bytes read from storage, results against torch's
reader bit for bit (replicated, sharded, mixed and resharded states), the switch, and a
rank that fails to read (or reads a bad checksum) failing every rank without a hang.

Checkpoints are saved with torch's ``dcp.save``; DCP deduplicates items saved under the
same key by several ranks, so values that differ between ranks have rank-unique keys.
"""

from __future__ import annotations

import errno
import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.device_mesh import init_device_mesh

from resilient_ckpt import _checksum, _dist
from resilient_ckpt._torch_compat import DTensor, Shard
from resilient_ckpt.async_ckpt import _read_once as read_once
from resilient_ckpt.async_ckpt import cached_metadata_filesystem_reader as cmfr
from resilient_ckpt.async_ckpt.cached_metadata_filesystem_reader import (
    CachedMetadataFileSystemReader,
    bytes_read_by_rank,
)
from resilient_ckpt.errors import RankCheckpointReadError
from resilient_ckpt.testing.faults import Action, Fault, Phase, flip_byte, inject
from resilient_ckpt.testing.launcher import launch
from resilient_ckpt.tiered._verifying_reader import VerifyingReader

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

WORLD = 4


def _replicated() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    state: dict[str, Any] = {
        f"layer{k}.weight": torch.randn(48 + 8 * k, 32, generator=g) for k in range(8)
    }
    state["layer0.bias"] = torch.randn(48, generator=g).to(torch.bfloat16)
    state["step"] = 11  # a bytes item
    return state


def _blank(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, DTensor):
            local = torch.zeros_like(value.to_local())
            out[key] = DTensor.from_local(local, value.device_mesh, value.placements)
        elif torch.is_tensor(value):
            out[key] = torch.zeros_like(value)
        elif isinstance(value, dict):
            out[key] = _blank(value)
        else:
            out[key] = None
    return out


def _bits(value: Any) -> Any:
    if isinstance(value, DTensor):
        value = value.to_local()
    if torch.is_tensor(value):
        return value.dtype, value.shape, value.contiguous().reshape(-1).view(torch.uint8)
    return value


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            _same(a[key], b[key])
            continue
        x, y = _bits(a[key]), _bits(b[key])
        if isinstance(x, tuple):
            assert x[:2] == y[:2] and torch.equal(x[2], y[2]), key
        else:
            assert x == y, key


def _stored(path: str) -> int:
    names = [n for n in os.listdir(path) if n.endswith(".distcp")]
    return sum(os.path.getsize(os.path.join(path, n)) for n in names)


def _load(state: dict[str, Any], reader: Any) -> dict[str, Any]:
    target = _blank(state)
    dcp.load(target, storage_reader=reader)
    return target


def _through_torch(state: dict[str, Any], path: str) -> dict[str, Any]:
    return _load(state, dcp.FileSystemReader(path))


# -- pure data parallelism ----------------------------------------------------------------------


def _pure_dp(rank: int, world: int, root: str) -> dict[str, Any]:
    state = _replicated()
    path = os.path.join(root, "dp")
    dcp.save(state, checkpoint_id=path)
    expected = _through_torch(state, path)
    _same(expected, state)
    counts = {}
    for mode in ("once", "off", "env off"):
        if mode == "env off":
            os.environ["RESILIENT_CKPT_READ_ONCE"] = "0"
        reader = CachedMetadataFileSystemReader(path, read_once=False if mode == "off" else None)
        os.environ.pop("RESILIENT_CKPT_READ_ONCE", None)
        _same(_load(state, reader), expected)
        counts[mode] = bytes_read_by_rank(reader)
        assert counts[mode][rank] == reader.bytes_read
    return {"counts": counts, "stored": _stored(path)}


def test_pure_data_parallel_restore_reads_the_checkpoint_once(tmp_path) -> None:
    results = launch(_pure_dp, WORLD, str(tmp_path), timeout=240)
    stored = results[0]["stored"]
    counts = results[0]["counts"]
    assert all(r["counts"] == counts for r in results)  # every rank gathered the same
    assert sum(counts["once"]) <= 1.1 * stored, (counts, stored)
    assert all(c > 0 for c in counts["once"]), counts  # every rank read its share
    assert max(counts["once"]) <= 0.5 * stored, counts  # and no rank read most of it
    for mode in ("off", "env off"):  # the switch: every rank reads everything, as torch does
        assert counts[mode] == [stored] * WORLD, (mode, counts, stored)


# -- sharded, mixed and resharded ---------------------------------------------------------------


def _full(world: int) -> torch.Tensor:
    return torch.randn(8 * world, 8, generator=torch.Generator().manual_seed(1))


def _mixed(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(2)
    rows = _full(world)[rank * 8 : (rank + 1) * 8].clone()
    return {
        "sharded": DTensor.from_local(rows, mesh, [Shard(0)], run_check=False),
        "replicated": torch.randn(40, 10, generator=g),
        "half": torch.randn(17, generator=g).to(torch.float16),
        f"rank{rank}.own": torch.full((16,), float(rank)),  # rank-unique: one reader
        "meta": {"epoch": 4, "name": "run"},  # bytes items
    }


def _mixed_and_resharded(rank: int, world: int, root: str) -> dict[str, Any]:
    path = os.path.join(root, "mixed")
    state = _mixed(rank, world)
    dcp.save(state, checkpoint_id=path)
    stored = _stored(path)
    out: dict[str, Any] = {"stored": stored}

    reader = CachedMetadataFileSystemReader(path)
    loaded = _load(state, reader)
    _same(loaded, _through_torch(state, path))
    _same(loaded, state)
    out["mixed"] = bytes_read_by_rank(reader)

    mesh = init_device_mesh("cpu", (world,))
    full = _full(world)
    columns = DTensor.from_local(full[:, rank * 2 : (rank + 1) * 2].clone(), mesh, [Shard(1)])
    for name, layout in (("columns", columns), ("whole", full)):
        resharded = {"sharded": layout}
        reader = CachedMetadataFileSystemReader(path)
        ours = _load(resharded, reader)
        _same(ours, _through_torch(resharded, path))
        _same(ours, resharded)
        out[name] = bytes_read_by_rank(reader)
    out["decoded"] = _as_cuda_destinations(state, path, columns)
    return out


def _as_cuda_destinations(state: dict[str, Any], path: str, columns: DTensor) -> int:
    """The loads again down the path CUDA destinations take (the reader decodes each chunk,
    the receiver views it by the metadata's shape and dtype), its transport routed over gloo
    on the CPU: no GPU here. Returns how many items arrived decoded."""
    arrived = []

    def copy_decoded(chunk: torch.Tensor, req: Any, *args: Any) -> None:
        arrived.append(req.storage_index)
        original_copy(chunk, req, *args)

    original_ready, original_transport = read_once._nccl_ready, read_once._chunk_transport
    original_copy = read_once._copy_decoded
    read_once._nccl_ready = lambda targets: True
    read_once._chunk_transport = lambda: (torch.device("cpu"), _dist.library_group())
    read_once._copy_decoded = copy_decoded
    try:
        for expected in (state, {"sharded": columns}):
            ours = _load(expected, CachedMetadataFileSystemReader(path))
            _same(ours, _through_torch(expected, path))
    finally:
        read_once._nccl_ready, read_once._chunk_transport = original_ready, original_transport
        read_once._copy_decoded = original_copy
    return len(arrived)


def test_sharded_mixed_and_resharded_loads_match_torch(tmp_path) -> None:
    results = launch(_mixed_and_resharded, WORLD, str(tmp_path), timeout=240)
    stored = results[0]["stored"]
    for load in ("mixed", "columns", "whole"):
        assert sum(results[0][load]) <= 1.1 * stored, (load, results[0][load], stored)
    # the resharded loads need only the sharded tensor, every chunk on every rank: read once
    assert 0 < sum(results[0]["columns"]) == sum(results[0]["whole"]) < stored
    assert all(facts["decoded"] > 0 for facts in results)


# -- a rank that fails to read ------------------------------------------------------------------


def _failing_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    path = os.path.join(root, "dp")
    state = _replicated()
    dcp.save(state, checkpoint_id=path)
    if rank == 1:
        original = cmfr.map_file

        def broken(name: str) -> torch.Tensor:
            raise OSError(errno.EIO, "injected read failure", name)

        cmfr.map_file = broken
    started = time.monotonic()
    try:
        _load(state, CachedMetadataFileSystemReader(path))
    except CheckpointException as exc:
        seconds = time.monotonic() - started
        failed = sorted(exc.failures)
        errors = [error for error, _ in exc.failures.values()]
    else:
        raise AssertionError(f"rank {rank}: the load did not fail")
    finally:
        if rank == 1:
            cmfr.map_file = original
    # The group still works, and the next load succeeds.
    _same(_load(state, CachedMetadataFileSystemReader(path)), state)
    return {
        "seconds": seconds,
        "failed": failed,
        "kinds": {type(e).__name__ for e in errors},
        "failed_ranks": {getattr(e, "failed_ranks", None) for e in errors},
        "message": str(errors[0]),
    }


def test_a_rank_that_fails_to_read_fails_every_rank(tmp_path) -> None:
    results = launch(_failing_rank, WORLD, str(tmp_path), timeout=240)
    for facts in results:
        assert facts["failed"] == list(range(WORLD))  # every rank raised in read_data
        assert facts["kinds"] == {RankCheckpointReadError.__name__}
        assert facts["failed_ranks"] == {(1,)}
        assert "rank 1 could not read __" in facts["message"]
        assert "injected read failure" in facts["message"]
        # agreed, not timed out (the collective deadline in tests is 90 s)
        assert facts["seconds"] < 60, facts


# -- the tiered reader (durable restore) --------------------------------------------------------


def _verifying_reader(path: str, read_once: bool | None = None) -> VerifyingReader:
    table = {}
    for name in os.listdir(path):
        if name.endswith(".distcp"):
            with open(os.path.join(path, name), "rb") as f:
                data = f.read()
            table[name] = (len(data), _checksum.crc32(data))
    candidates = {name: [os.path.join(path, name)] for name in table}
    metadata = os.path.join(path, ".metadata")
    return VerifyingReader(path, metadata, candidates, table, read_once=read_once)


def _expect_failure(state: dict[str, Any], make_reader: Any) -> dict[str, Any]:
    try:
        _load(state, make_reader())
    except CheckpointException as exc:
        errors = [error for error, _ in exc.failures.values()]
        return {
            "kinds": {type(e).__name__ for e in errors},
            "failed_ranks": {getattr(e, "failed_ranks", None) for e in errors},
            "message": str(errors[0]),
        }
    raise AssertionError("the load did not fail")


def _durable(rank: int, world: int, root: str) -> dict[str, Any]:
    path = os.path.join(root, "durable")
    state = _replicated()
    state[f"rank{rank}.own"] = torch.full((64,), float(rank))
    dcp.save(state, checkpoint_id=path)
    out: dict[str, Any] = {"stored": _stored(path)}
    reader = _verifying_reader(path)
    _same(_load(state, reader), _through_torch(state, path))
    out["counts"] = bytes_read_by_rank(reader)
    reader = _verifying_reader(path, read_once=False)
    _same(_load(state, reader), _through_torch(state, path))
    out["off"] = bytes_read_by_rank(reader)
    # Rank 2 cannot open data files (the fault kit, on its storage backend).
    fault = Fault(Phase.OPEN_READ, Action.RAISE, ranks=[2], match="*.distcp", times=None)
    with inject(fault):
        out["unreadable"] = _expect_failure(state, lambda: _verifying_reader(path))
    # A data file whose bytes no longer match the table: its reader's checksum fails.
    reader = _verifying_reader(path)
    dist.barrier()
    if rank == 0:
        flip_byte(os.path.join(path, "__3_0.distcp"), 100)
    dist.barrier()
    out["corrupt"] = _expect_failure(state, lambda: reader)
    return out


def test_durable_tier_restore_reads_each_file_once_and_fails_together(tmp_path) -> None:
    results = launch(_durable, WORLD, str(tmp_path), timeout=240)
    facts = results[0]
    stored = facts["stored"]
    assert sum(facts["counts"]) <= 1.1 * stored, facts
    # switched off: each rank reads (and checksums) every file, all holding items it needs
    assert facts["off"] == [stored] * WORLD, facts
    for facts in results:
        unreadable, corrupt = facts["unreadable"], facts["corrupt"]
        assert unreadable["kinds"] == {RankCheckpointReadError.__name__}, unreadable
        assert unreadable["failed_ranks"] == {(2,)}, unreadable
        assert "rank 2 could not read __" in unreadable["message"]
        assert corrupt["kinds"] == {RankCheckpointReadError.__name__}, corrupt
        assert "__3_0.distcp" in corrupt["message"] and "checksum" in corrupt["message"]
        assert len(next(iter(corrupt["failed_ranks"]))) == 1
