"""Read-once loads from object stores (4 gloo ranks, the S3 server and MSC's POSIX provider in
one launch): an object is downloaded whole, so each is downloaded by one rank and its items
carried to the others; a rank whose download fails (the fault kit) fails every rank."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from resilient_ckpt.async_ckpt.cached_metadata_filesystem_reader import (
    CachedMetadataFileSystemReader,
    bytes_read_by_rank,
)
from resilient_ckpt.errors import RankCheckpointReadError
from resilient_ckpt.storage import get_backend
from resilient_ckpt.testing.faults import Action, Fault, Phase, inject
from resilient_ckpt.testing.launcher import launch

pytestmark = [pytest.mark.objstore, pytest.mark.dist, pytest.mark.timeout(300)]

WORLD = 4


def _state(rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    state: dict[str, Any] = {f"w{k}": torch.randn(32 + 4 * k, 16, generator=g) for k in range(6)}
    state[f"rank{rank}.own"] = torch.full((8,), float(rank))  # one reader
    return state


def _blank(state: dict[str, Any]) -> dict[str, Any]:
    return {key: torch.zeros_like(value) for key, value in state.items()}


def _exact(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def _one_store(rank: int, url: str) -> dict[str, Any]:
    import multistorageclient as msc

    state = _state(rank)
    dcp.save(state, storage_writer=msc.torch.MultiStorageFileSystemWriter(url))
    backend = get_backend(url)
    stored = sum(
        backend.size(backend.join(url, n)) for n in backend.list(url) if n.endswith(".distcp")
    )
    out: dict[str, Any] = {"stored": stored}
    for mode, read_once in (("once", None), ("off", False)):
        reader = CachedMetadataFileSystemReader(url, thread_count=2, read_once=read_once)
        loaded = _blank(state)
        dcp.load(loaded, storage_reader=reader)
        _exact(loaded, state)
        out[mode] = bytes_read_by_rank(reader)
    fault = Fault(Phase.OPEN_READ, Action.RAISE, ranks=[3], match="*.distcp", times=None)
    with inject(fault):  # the kit's backend has no object-version query: read it uncached
        reader = CachedMetadataFileSystemReader(url, cache_metadata=False, thread_count=2)
    try:
        dcp.load(_blank(state), storage_reader=reader)
    except CheckpointException as exc:
        errors = [error for error, _ in exc.failures.values()]
        out["kinds"] = {type(e).__name__ for e in errors}
        out["failed_ranks"] = {getattr(e, "failed_ranks", None) for e in errors}
    else:
        raise AssertionError("the load under a failing download did not fail")
    return out


def _stores(rank: int, world: int, urls: list[str]) -> list[dict[str, Any]]:
    return [_one_store(rank, url) for url in urls]


def test_object_store_restore_downloads_each_object_once(s3_and_posix_stores) -> None:
    urls = [store.url("read-once") for store in s3_and_posix_stores]
    results = launch(_stores, WORLD, urls, timeout=280)
    for store, facts in zip(s3_and_posix_stores, results[0], strict=True):
        stored = facts["stored"]
        assert sum(facts["once"]) <= 1.1 * stored, (store.kind, facts)
        assert facts["off"] == [stored] * WORLD, (store.kind, facts)  # each rank, every object
    for per_store in results:
        for facts in per_store:
            assert facts["kinds"] == {RankCheckpointReadError.__name__}, facts
            assert facts["failed_ranks"] == {(3,)}, facts
