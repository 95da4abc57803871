"""A data file's DCP write results, pickled once where they are made, decoded once per content.

Decision: a DCP save's finalize moved every rank's ``WriteResult`` list (one per item, each
a few objects) through pickle three times in the trainers: unpickled from the results file
the background write left, pickled again for the gather to the coordinator, and unpickled
there once per rank. At 2000 items that is ~4 ms a pass, and every rank waits in the
finalize for the coordinator's commit. Yet the results are a function of the plan and of the
items' sizes only: a save of an unchanged structure writes the very same list as the
previous one (offsets within files, file names relative to the checkpoint).

So the background write pickles each file's results once (:func:`encode`), and these bytes
travel as they are: an :class:`EncodedResults` is a plain ``list`` to every reader whose
pickle is its bytes, through the results file and the gather alike. Unpickling one calls
:func:`decode`, which keeps a small process-wide cache keyed by the bytes themselves: equal
bytes are equal results, so a steady save's results are unpickled once per process, not once
per save and rank; other bytes (a changed structure, another checkpoint) are simply
unpickled. The cache is bounded: 64 payloads and 16 MiB of them (decoded, ~7x that in
objects: ~100 bytes a result pickled, ~780 as objects), least recently used dropped first;
a payload over the bound is decoded every time. A steady 2000-tensor save on 2 ranks keeps
4 payloads, ~0.4 MiB.

Decoded ``WriteResult`` objects are therefore shared between saves. torch treats them as
values (``WriteResult`` and ``MetadataIndex`` are frozen; nothing mutates a ``_StorageInfo``
once made), and so must every reader; ``copy.deepcopy`` gives independent ones. A list
changed in place (any list mutation) drops its bytes and pickles as the plain list it is.
"""

from __future__ import annotations

import copy
import pickle
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from ._list_hooks import call_first

_MAX_ENTRIES = 64
_MAX_BYTES = 16 << 20

_cache: OrderedDict[bytes, tuple[Any, ...]] = OrderedDict()
_cached_bytes = 0
_lock = threading.Lock()


class EncodedResults(list):
    """Write results with their pickle (``payloads``: one per data file, in order)."""

    __slots__ = ("_payloads",)

    def __init__(self, results: Iterable[Any], payloads: tuple[bytes, ...] | None) -> None:
        super().__init__(results)
        self._payloads = payloads

    @property
    def payloads(self) -> tuple[bytes, ...] | None:
        """The bytes this list pickles as (None once it was changed in place)."""
        return self._payloads

    def __reduce_ex__(self, protocol: Any) -> Any:
        if self._payloads is None:
            return list, (list(self),)
        return decode, self._payloads

    def __copy__(self) -> EncodedResults:
        return EncodedResults(self, self._payloads)

    def __deepcopy__(self, memo: dict) -> list:
        return [copy.deepcopy(result, memo) for result in self]


def _drop_payloads(results: EncodedResults) -> None:
    results._payloads = None


# In place, the list no longer is what its bytes say.
_CHANGING = (
    "__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "extend", "insert",
    "pop", "remove", "clear", "sort", "reverse",
)  # fmt: skip
call_first(EncodedResults, _CHANGING, _drop_payloads)


def encode(results: list[Any]) -> EncodedResults:
    """``results`` (one data file's) with their pickle; made where they are written."""
    payload = pickle.dumps(list(results), protocol=pickle.HIGHEST_PROTOCOL)
    return EncodedResults(results, (payload,))


def decode(*payloads: bytes) -> EncodedResults:
    """The results the ``payloads`` pickle, concatenated (what unpickling one calls)."""
    results: list[Any] = []
    for payload in payloads:
        results.extend(_decoded(payload))
    return EncodedResults(results, payloads)


def _decoded(payload: bytes) -> tuple[Any, ...]:
    global _cached_bytes
    with _lock:
        found = _cache.get(payload)
        if found is not None:
            _cache.move_to_end(payload)
            return found
    found = tuple(pickle.loads(payload))
    if len(payload) <= _MAX_BYTES:
        with _lock:
            if payload not in _cache:
                _cache[payload] = found
                _cached_bytes += len(payload)
            while len(_cache) > _MAX_ENTRIES or _cached_bytes > _MAX_BYTES:
                dropped, _ = _cache.popitem(last=False)
                _cached_bytes -= len(dropped)
    return found


def join(parts: Iterable[list[Any]]) -> list[Any]:
    """The concatenation of several files' results: an :class:`EncodedResults` (pickled as
    every part's bytes) when every part is one, else a plain list."""
    parts = list(parts)
    joined = [result for part in parts for result in part]
    payloads: list[bytes] = []
    for part in parts:
        if not isinstance(part, EncodedResults) or part.payloads is None:
            return joined
        payloads.extend(part.payloads)
    return EncodedResults(joined, tuple(payloads))


def clear_cache() -> None:
    """Forget every decoded payload (tests)."""
    global _cached_bytes
    with _lock:
        _cache.clear()
        _cached_bytes = 0
