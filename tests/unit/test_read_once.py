"""Read-once planning (``async_ckpt._read_once.plan_reads``): who reads each shared unit and
who sends what to whom; and the single-process load, which reads as torch's reader does and
counts what it read. The multi-process loads are in ``tests/dist/test_read_once_dist.py``."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex

from resilient_ckpt._torch_compat import no_dist_kwargs
from resilient_ckpt.async_ckpt._read_once import ReadOrders, plan_reads
from resilient_ckpt.async_ckpt.cached_metadata_filesystem_reader import (
    CachedMetadataFileSystemReader,
    bytes_read_by_rank,
)
from resilient_ckpt.errors import ConfigurationError

pytestmark = pytest.mark.timeout(60)


def _index(name: str) -> MetadataIndex:
    return MetadataIndex(name, [0])


def _item_units(sizes: dict[str, int], files: dict[str, str] | None = None):
    """unit_of for items ``name -> size``; with ``files``, whole files (``name -> file``)."""

    def unit_of(index: MetadataIndex):
        if files is None:
            return index.fqn, sizes[index.fqn]
        name = files[index.fqn]
        return name, sum(s for n, s in sizes.items() if files[n] == name)

    return unit_of


def _check_consistent(needs, orders: list[ReadOrders], unit_of) -> dict[int, int]:
    """Every rank ends up with each item it needs exactly once (read or received), every
    send is a receive on the other side, and each unit is read by one rank. Returns the
    bytes each rank reads."""
    world = len(needs)
    readers: dict[object, set[int]] = {}
    for rank in range(world):
        incoming = [i for _, items in orders[rank].receives for i in items]
        assert len(incoming) == len(set(incoming))
        for sender, items in orders[rank].receives:
            assert (rank, items) in orders[sender].sends
            assert sender != rank
        sent = [i for _, items in orders[rank].sends for i in items]
        read = {i for i in needs[rank] if i not in incoming} | set(sent)
        for index in read:
            readers.setdefault(unit_of(index)[0], set()).add(rank)
        assert set(incoming) <= set(needs[rank])
    assert all(len(ranks) == 1 for ranks in readers.values()), readers
    load = dict.fromkeys(range(world), 0)
    sizes = {}
    for rank in range(world):
        for index in needs[rank]:
            unit, size = unit_of(index)
            sizes[unit] = size
    for unit, ranks in readers.items():
        load[next(iter(ranks))] += sizes[unit]
    return load


def test_pure_data_parallel_spreads_the_reads_evenly() -> None:
    sizes = {f"t{k}": 100 for k in range(8)}
    items = [_index(n) for n in sizes]
    needs = [items] * 4
    orders = plan_reads(needs, _item_units(sizes))
    assert orders is not None
    load = _check_consistent(needs, orders, _item_units(sizes))
    assert sorted(load.values()) == [200, 200, 200, 200]
    for rank, mine in enumerate(orders):
        assert sorted(peer for peer, _ in mine.sends) == [r for r in range(4) if r != rank]
        # one list to every peer: the plan pickles it once
        assert len({id(items) for _, items in mine.sends}) == 1
    assert plan_reads(needs, _item_units(sizes)) == orders  # deterministic


def test_nothing_shared_plans_nothing() -> None:
    sizes = {f"rank{r}": 10 for r in range(3)}
    needs = [[_index(f"rank{r}")] for r in range(3)]
    assert plan_reads(needs, _item_units(sizes)) is None


def test_a_rank_busy_with_its_own_shard_reads_less_of_the_shared() -> None:
    sizes = {"own0": 1000, "a": 100, "b": 100, "c": 100, "d": 100}
    shared = [_index(n) for n in "abcd"]
    needs = [[_index("own0"), *shared], shared]
    orders = plan_reads(needs, _item_units(sizes))
    assert orders is not None
    load = _check_consistent(needs, orders, _item_units(sizes))
    assert load == {0: 1000, 1: 400}


def test_largest_shared_units_are_placed_first() -> None:
    sizes = {"big": 300, "m1": 100, "m2": 100, "m3": 100}
    items = [_index(n) for n in ("m1", "m2", "m3", "big")]
    needs = [items, items]
    orders = plan_reads(needs, _item_units(sizes))
    assert orders is not None
    load = _check_consistent(needs, orders, _item_units(sizes))
    assert sorted(load.values()) == [300, 300]


def test_whole_file_units_send_only_the_items_each_rank_needs() -> None:
    sizes = {"a": 10, "b": 20, "c": 30}
    files = {"a": "f0", "b": "f0", "c": "f1"}
    unit_of = _item_units(sizes, files)
    needs = [[_index("a"), _index("c")], [_index("b"), _index("c")]]
    orders = plan_reads(needs, unit_of)
    assert orders is not None
    load = _check_consistent(needs, orders, unit_of)
    assert sorted(load.values()) == [30, 30]  # f0 (a+b) on one rank, f1 (c) on the other
    sent = {(s, r, tuple(i.fqn for i in items)) for s in (0, 1) for r, items in orders[s].sends}
    f0_reader = 0 if (0, 1, ("b",)) in sent else 1
    assert sent == (
        {(0, 1, ("b",)), (1, 0, ("c",))} if f0_reader == 0 else {(1, 0, ("a",)), (0, 1, ("c",))}
    )


def test_single_process_load_reads_alone_and_counts(tmp_path) -> None:
    state = {"w": torch.randn(64, 8), "b": torch.arange(5), "meta": {"step": 7}}
    path = str(tmp_path / "ck")
    dcp.save(state, checkpoint_id=path, **no_dist_kwargs(dcp.save))
    target = {"w": torch.zeros(64, 8), "b": torch.zeros(5, dtype=torch.int64), "meta": {"step": 0}}
    reader = CachedMetadataFileSystemReader(path)
    assert reader.read_once
    dcp.load(target, storage_reader=reader, **no_dist_kwargs(dcp.load))
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
    assert target["meta"] == {"step": 7}
    names = [n for n in os.listdir(path) if n != ".metadata"]
    stored = sum(os.path.getsize(os.path.join(path, n)) for n in names)
    assert reader.bytes_read == stored
    assert bytes_read_by_rank(reader) == [stored]


def test_switch_from_the_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("RESILIENT_CKPT_READ_ONCE", "0")
    assert not CachedMetadataFileSystemReader(str(tmp_path)).read_once
    assert CachedMetadataFileSystemReader(str(tmp_path), read_once=True).read_once
    monkeypatch.setenv("RESILIENT_CKPT_READ_ONCE", "sometimes")
    with pytest.raises(ConfigurationError, match="RESILIENT_CKPT_READ_ONCE"):
        CachedMetadataFileSystemReader(str(tmp_path))
