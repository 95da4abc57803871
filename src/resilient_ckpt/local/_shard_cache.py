"""The steady-state fast path of a local save: reuse the previous shard layout.

Decision: :func:`._format.plan_shard` pops every tensor of the state (a placeholder object
each), records where each tensor's bytes go, pickles the hollow state with those records
as the shard header, and puts the tensors back: ~15 us per tensor, repeated identically
while a job saves the same structure. For a :class:`BasicTensorAwareStateDict` (plain nested
dicts, lists and tuples) this cache instead walks the state once (~1 us per entry, ~0.2 us
in a dict of tensors of one type) and compares it with the state the cached layout was
planned from:

* every container's type and keys (dicts) or length (lists, tuples), in order;
* for every tensor, what its placeholder and record hold: type, shape, dtype, device,
  layout, ``requires_grad``;
* every other leaf by value, when it is of a type whose equality is exact and whose pickle
  depends only on its value (``int``, ``float``, ``str``, ``bytes``, ``bool``, ``None``);
  a leaf of any other type disables the cache for that state (its pickle is re-made).

Equal walks mean an identical header and identical records, so the cached ones are reused
with the *current* tensors (their bytes are read when the request is staged). The layout is
cached only if the walk met exactly the tensors ``pop_tensors`` popped, in order (checked
object by object), and only for states whose tensors are on their home devices.
"""

from __future__ import annotations

import operator
import pickle
from collections.abc import Callable
from typing import Any

import torch

from ..async_ckpt._staging import TensorBatch
from .basic_state_dict import BasicTensorAwareStateDict

_EXACT = (int, str, bytes, bool, type(None))
_TENSORS = (torch.Tensor, torch.nn.Parameter)


class _Unsupported(Exception):
    pass


# A tensor's token; for a dict of tensors of one type (a model's parameters) the tokens are
# made by C-level ``map`` calls, one by one elsewhere.
_TENSOR_TOKEN = operator.attrgetter(
    "__class__", "shape", "dtype", "device", "layout", "requires_grad"
)


def _walk(obj: Any, tokens: list, tensors: list) -> None:
    kind = type(obj)
    if kind is dict:
        tokens.append((kind, tuple(obj)))
        values = list(obj.values())
        kinds = list(map(type, values))
        if values and kinds[0] in _TENSORS and kinds.count(kinds[0]) == len(kinds):
            tensors.extend(values)
            tokens.extend(map(_TENSOR_TOKEN, values))
            return
        for value in values:
            _walk(value, tokens, tensors)
    elif kind is list or kind is tuple:
        tokens.append((kind, len(obj)))
        for value in obj:
            _walk(value, tokens, tensors)
    elif kind in _TENSORS:
        tensors.append(obj)
        tokens.append(_TENSOR_TOKEN(obj))
    elif kind is float:
        tokens.append((kind, obj.hex()))  # exact: 0.0 == -0.0 but they pickle apart
    elif kind in _EXACT:
        tokens.append((kind, obj))
    else:
        # Subclasses of dict/list/tuple (named tuples), other tensor types, objects whose
        # pickle may not follow their equality: always planned in full.
        raise _Unsupported(kind.__name__)


def walk(state: Any) -> tuple[list, TensorBatch] | None:
    """``(tokens, tensors)`` of ``state``; the tensors in order, as the batch a shard
    layout stages them in."""
    tokens: list = []
    tensors = TensorBatch()
    try:
        _walk(state, tokens, tensors)
    except _Unsupported:
        return None
    return tokens, tensors


def _unpickle_list(payload: bytes) -> list:
    return list(pickle.loads(payload))


class PickledOnce(list):
    """A list that is never changed, pickled once: the records of a cached layout travel in
    every save's request, and pickling 2000 record dataclasses costs ~3 ms each time."""

    def __init__(self, items: Any) -> None:
        super().__init__(items)
        # Now, while the save that planned the layout pays for planning anyway.
        self._payload = pickle.dumps(list(self), protocol=pickle.HIGHEST_PROTOCOL)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return _unpickle_list, (self._payload,)


class ShardPlanCache:
    """One manager's memory of its previous shard layout (see the module docstring)."""

    def __init__(self) -> None:
        self._tokens: list | None = None
        self._layout: Any = None
        self.hits = 0
        self.misses = 0

    def plan(self, state: Any, plan_full: Callable[[Any], Any]) -> Any:
        """``plan_full(state)`` or, for a state laid out as last time, the cached layout
        with the current tensors."""
        from ._format import ShardLayout

        walked = None
        if type(state) is BasicTensorAwareStateDict and state.reusable_layout():
            walked = walk(state.state_dict)
        if walked is not None and self._layout is not None and walked[0] == self._tokens:
            self.hits += 1
            cached: ShardLayout = self._layout
            return ShardLayout(
                cached.header, walked[1], cached.records, cached.data_start, cached.size
            )
        layout = plan_full(state)
        self.misses += 1
        self._tokens, self._layout = None, None
        if walked is not None and len(walked[1]) == len(layout.tensors):
            if all(a is b for a, b in zip(walked[1], layout.tensors, strict=True)):
                self._tokens = walked[0]
                self._layout = ShardLayout(
                    layout.header, [], PickledOnce(layout.records), layout.data_start, layout.size
                )
        return layout
