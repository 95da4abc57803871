"""Write results pickled once where they are made, decoded once per content."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from resilient_ckpt.async_ckpt import _encoded_results as er


@pytest.fixture(autouse=True)
def _fresh_cache():
    er.clear_cache()
    yield
    er.clear_cache()


def _results(name: str, count: int, base: int = 0) -> list[WriteResult]:
    return [
        WriteResult(
            index=MetadataIndex(f"layer{i}.weight", torch.Size([0]), 0),
            size_in_bytes=16,
            storage_data=_StorageInfo(name, base + 16 * i, 16),
        )
        for i in range(count)
    ]


def test_pickles_as_its_bytes_and_equal_bytes_decode_to_the_same_objects() -> None:
    made = er.encode(_results("__0_0.distcp", 50))
    assert made == _results("__0_0.distcp", 50)
    blob = pickle.dumps(made, protocol=pickle.HIGHEST_PROTOCOL)
    (payload,) = made.payloads
    assert len(blob) < len(payload) + 200  # the bytes, not the objects again
    first, second = pickle.loads(blob), pickle.loads(blob)
    assert first == made and isinstance(first, list)
    assert all(a is b for a, b in zip(first, second, strict=True))  # decoded once
    # Other bytes (another layout) are decoded on their own.
    other = pickle.loads(pickle.dumps(er.encode(_results("__0_0.distcp", 50, base=8))))
    assert other != first
    assert other[0].storage_data.offset == 8


def test_a_list_changed_in_place_pickles_as_what_it_holds() -> None:
    changes = {
        "append": lambda r: r.append(_results("x", 1)[0]),
        "setitem": lambda r: r.__setitem__(0, _results("y", 1)[0]),
        "delitem": lambda r: r.__delitem__(0),
        "pop": lambda r: r.pop(),
        "extend": lambda r: r.extend(_results("z", 2)),
        "iadd": lambda r: r.__iadd__(_results("z", 2)),
        "clear": lambda r: r.clear(),
        "reverse": lambda r: r.reverse(),
    }
    for what, change in changes.items():
        results = er.encode(_results("f", 3))
        change(results)
        assert results.payloads is None, what
        assert pickle.loads(pickle.dumps(results)) == list(results), what


def test_copies() -> None:
    made = er.encode(_results("f", 3))
    shallow = copy.copy(made)
    assert shallow == made and shallow.payloads == made.payloads
    shallow.append(_results("g", 1)[0])
    assert len(made) == 3 and made.payloads is not None
    deep = copy.deepcopy(made)
    assert deep == made
    assert all(a is not b for a, b in zip(deep, made, strict=True))


def test_join_keeps_every_files_bytes_or_falls_back_to_a_plain_list() -> None:
    a, b = er.encode(_results("a", 4)), er.encode(_results("b", 5))
    joined = er.join([a, b])
    assert isinstance(joined, er.EncodedResults) and joined.payloads == a.payloads + b.payloads
    assert pickle.loads(pickle.dumps(joined)) == list(a) + list(b)
    assert er.join([]) == [] and isinstance(er.join([]), er.EncodedResults)
    mixed = er.join([a, _results("c", 2)])
    assert type(mixed) is list and mixed == list(a) + _results("c", 2)


def test_the_cache_is_bounded(monkeypatch) -> None:
    monkeypatch.setattr(er, "_MAX_ENTRIES", 3)
    for n in range(10):
        pickle.loads(pickle.dumps(er.encode(_results(f"file{n}", 5))))
    assert len(er._cache) == 3
    assert er._cached_bytes == sum(map(len, er._cache))
    monkeypatch.setattr(er, "_MAX_BYTES", 2000)  # a payload over the bound: never kept
    big = er.encode(_results("big", 100))
    assert len(big.payloads[0]) > 2000
    pickle.loads(pickle.dumps(big))
    assert big.payloads[0] not in er._cache
