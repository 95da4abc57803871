"""Planning a local shard, and the one memory that spares a steady save the work per tensor.

Decision: a shard header (:mod:`._format`) is the pickle of the hollow state and the tensor
records. A job saves the same structure again and again, and most of that pickle is then the
same every time: the records, and every part of the state that holds tensors and nothing else
(a model's ``state_dict()``; an optimizer's ``state``, one dict of tensors per parameter).
Pickling those costs time per tensor at every save, so each is pickled once and carried as its
bytes, a :class:`Pickled` value that pickles as ``pickle.loads(payload)``. The header stays
one ordinary pickle, in the format earlier releases wrote and read (the restricted unpickler
allows that call, see ``_restricted_pickle.load_state``).

"Same as the last save?" is answered once, by the library's structure walk
(:mod:`..async_ckpt._structure`): the structure's key and the tensors' description, in one
:class:`~..async_ckpt._structure.StructureCache`. Under that answer a :class:`ShardPlanCache`
keeps what the last full planning made: the records' bytes, each tensor's offset, and for a
plain state (below) its header, the placeholders outside the parts pickled once, and those
parts. A save of the same structure takes them with its own tensors; if its plain values
changed (the iteration, the learning rate), the hollow state is built again from those pieces
beside the live one, visiting no tensor, into the bytes a full planning would write.

A full planning takes one of two ways:

* a *plain* ``BasicTensorAwareStateDict`` (dicts, ``OrderedDict``s, lists and tuples of plain
  tensors and exact leaves, ``Structure.plain``) is not popped: its hollow state is built
  beside it, as ``pop_tensors`` would leave it. Each outermost container holding only tensors
  (and such containers) is pickled whole, unless a dict or list inside it is also met
  elsewhere: one pickle would then make two objects of it. Dicts and lists shared by identity
  stay shared; tuples are rebuilt at each visit, as ``pop_tensors`` does;
* any other state pops its tensors, is pickled as it is and gets its tensors back. Its records
  are reused while its tensors are described as the last ones (under a key of their own: the
  walk does not see into such a state).

Alternatives not taken: a pickler whose ``reducer_override`` emits the cached bytes (pickle
calls it for no exact ``dict``, and raw bytes spliced into a pickle stream would renumber its
memo); a header of several pickles side by side (the state's pickle would still need a
reference to the parts pickled apart, which is what ``pickle.loads`` is, and older releases
could not read it).
"""

from __future__ import annotations

import dataclasses
import itertools
import pickle
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .._unpicklable import describe_unpicklable
from ..async_ckpt._structure import PLAIN_TENSOR_TYPES, Structure, StructureCache, walk
from ..errors import ConfigurationError
from ._format import ShardLayout, TensorRecord, align, header_of
from ._whole import snapshot_whole
from .base_state_dict import TensorAwareStateDict
from .basic_state_dict import BasicTensorAwareStateDict, TensorPlaceholder

_CONTAINERS = frozenset({dict, OrderedDict, list, tuple})


class Pickled:
    """A value pickled once, carried as its bytes: it pickles as ``pickle.loads(payload)``.
    ``size``: how many tensors the value stands for."""

    __slots__ = ("payload", "size")

    def __init__(self, value: Any, size: int = 0) -> None:
        self.payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        self.size = size

    def __reduce__(self) -> tuple[Any, ...]:
        return pickle.loads, (self.payload,)


@dataclass(frozen=True)
class _Planned:
    """What a full planning made, for the saves of the same structure.

    For a plain state also: its header and the plain values it holds, the placeholders
    outside the parts pickled whole and, for each container holding only tensors in visiting
    order, its part (None: pickled with the rest), all in the order a build meets them.
    """

    records: Pickled
    offsets: list[int]
    data_bytes: int
    header: bytes = b""
    values: list = field(default_factory=list)
    loose: list[TensorPlaceholder] = field(default_factory=list)
    parts: list[Pickled | None] = field(default_factory=list)

    def layout(
        self, header: bytes, tensors: list[torch.Tensor], memo: ShardPlanCache | None
    ) -> ShardLayout:
        plan = memo.kept.generation if memo is not None else None
        return ShardLayout(header, tensors, self.offsets, self.data_bytes, plan)


class ShardPlanCache:
    """One manager's memory of its last full planning (see the module docstring).

    ``hits``: saves that reused it; ``refreshes``: those of them whose header was made again
    (new plain values, or a popped state); ``misses``: saves planned without it.
    """

    def __init__(self) -> None:
        self.kept: StructureCache[_Planned] = StructureCache()
        self.hits = 0
        self.refreshes = 0
        self.misses = 0


def plan_shard(state: TensorAwareStateDict, memo: ShardPlanCache | None = None) -> ShardLayout:
    """Lay ``state`` out as a shard; ``state`` is left as it was. With ``memo``, reuse what
    its last planning made, for a state of the same structure.

    A state whose ``pop_tensors`` is not implemented is saved whole (see :mod:`._whole`).
    """
    if type(state) is not BasicTensorAwareStateDict or (structure := _plain(state)) is None:
        return _plan_popped(state, memo)
    if memo is not None:
        reused = _reused(state, structure, memo)
        if reused is not None:
            return reused
    planned, tensors = _plan_beside(state, structure)
    if memo is not None:
        memo.misses += 1
        if len(tensors) == len(structure.tensors) and all(
            a is b for a, b in zip(tensors, structure.tensors, strict=True)
        ):
            memo.kept.remember(structure.key, tensors, planned)
        else:  # the walk met other tensors than the build: not reused
            memo.kept.clear()
    return planned.layout(planned.header, tensors, memo)


def _reused(
    state: BasicTensorAwareStateDict, structure: Structure, memo: ShardPlanCache
) -> ShardLayout | None:
    """The layout of the last planning with this save's tensors (and, for new plain values,
    its header made again), if it was made for this structure."""
    kept = memo.kept.lookup(structure.key, structure.tensors)
    if kept is None:
        return None
    if structure.values != kept.values:
        header = _rebuilt_header(state, kept)
        if header is None:
            return None
        kept = dataclasses.replace(kept, header=header, values=structure.values)
        memo.kept.keep_product(kept)
        memo.refreshes += 1
    memo.hits += 1
    return kept.layout(kept.header, structure.tensors, memo)


def _plain(state: BasicTensorAwareStateDict) -> Structure | None:
    """The structure of a plain state whose tensors are on their home devices, else None."""
    if not state.reusable_layout():
        return None
    structure = walk(state.state_dict)
    return structure if structure is not None and structure.plain else None


def _plan_popped(state: TensorAwareStateDict, memo: ShardPlanCache | None) -> ShardLayout:
    try:
        tensors = state.pop_tensors()
    except NotImplementedError:
        return _plan_popped(snapshot_whole(state), memo)
    try:
        key = _popped_key(tensors)
        kept = memo.kept.lookup(key, tensors) if memo is not None else None
        if kept is None:
            kept = _Planned(*_records(tensors))
            if memo is not None:
                memo.misses += 1
                memo.kept.remember(key, tensors, kept)
        elif memo is not None:
            memo.hits += 1
            memo.refreshes += 1
        header = _header(state, state, kept.records)
    finally:
        state.insert_tensors(tensors)
    return kept.layout(header, tensors, memo)


def _popped_key(tensors: list[torch.Tensor]) -> tuple:
    """The memory's key for a state the walk does not see into: which tensors are flagged
    ``_is_param`` (recorded as parameters, as ``isinstance`` says; the tensors' description
    does not tell)."""
    flags = map(getattr, tensors, itertools.repeat("_is_param"), itertools.repeat(False))
    return ("popped", tuple(flags))


def _plan_beside(
    state: BasicTensorAwareStateDict, structure: Structure
) -> tuple[_Planned, list[torch.Tensor]]:
    """A plain state's full planning: its hollow state built beside it, with new
    placeholders and parts (see the module docstring)."""
    build = _Build(_shared(state.state_dict))
    hollow = rebuild(state.state_dict, build.leaf, build.whole, {})
    records, offsets, data_bytes = _records(build.tensors)
    header = _header(state, _shell(state, hollow), records)
    planned = _Planned(
        records, offsets, data_bytes, header, structure.values, build.loose, build.parts
    )
    return planned, build.tensors


def _rebuilt_header(state: BasicTensorAwareStateDict, kept: _Planned) -> bytes | None:
    """The header of a plain state of ``kept``'s structure with other plain values, from
    ``kept``'s pieces; None where they do not fit (then it is planned in full)."""
    replay = _Replay(kept)
    try:
        hollow = rebuild(state.state_dict, replay.leaf, replay.whole, {})
    except _Mismatch:
        return None
    if replay.loose < len(kept.loose) or replay.parts < len(kept.parts):
        return None
    return _header(state, _shell(state, hollow), kept.records)


def _records(tensors: list[torch.Tensor]) -> tuple[Pickled, list[int], int]:
    """Each tensor's record (checked first), pickled; each tensor's offset in the data
    section; the data section's size."""
    records: list[TensorRecord] = []
    offsets: list[int] = []
    offset = 0
    for index, tensor in enumerate(tensors):
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.device.type == "meta":
            raise ConfigurationError(
                f"tensor #{index} ({tensor.layout}, {tensor.dtype}, {tensor.device}) cannot be "
                "stored in a local checkpoint: only dense tensors with data are supported"
            )
        nbytes = tensor.numel() * tensor.element_size()
        is_param = isinstance(tensor, torch.nn.Parameter)
        records.append(
            TensorRecord(
                tensor.dtype, tuple(tensor.shape), offset, nbytes, tensor.requires_grad, is_param
            )
        )
        offsets.append(offset)
        offset = align(offset + nbytes)
    return Pickled(records), offsets, offset


def _header(state: TensorAwareStateDict, hollow: Any, records: Pickled) -> bytes:
    try:
        body = pickle.dumps((hollow, records), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        where = describe_unpicklable(getattr(state, "state_dict", state))
        raise ConfigurationError(
            f"the non-tensor part of the state cannot be pickled"
            f"{f': {where}' if where else ''}: {type(exc).__name__}: {exc}. Every value "
            "that is not a tensor must be picklable (no lambdas, open files, locks or "
            "process groups)"
        ) from exc
    return header_of(body)


def _shell(state: BasicTensorAwareStateDict, hollow: Any) -> BasicTensorAwareStateDict:
    """A new object that pickles as ``state`` hollow, holding ``hollow`` (the same
    attributes in the same order as ``pop_tensors`` leaves them)."""
    shell = BasicTensorAwareStateDict.__new__(BasicTensorAwareStateDict)
    shell.__dict__.update(state.__dict__)
    shell.__dict__.update(state_dict=hollow, _is_hollow=True, _origin=None)
    return shell


# -- building the hollow state beside the live one --------------------------------------------


class _Mismatch(Exception):
    """The state does not line up with the kept placeholders and parts."""


class _Build:
    """A full planning's build: new placeholders, and the parts it pickles whole."""

    def __init__(self, shared: set[int]) -> None:
        self.shared = shared
        self.sizes: dict[int, int | None] = {}
        self.tensors: list[torch.Tensor] = []
        self.loose: list[TensorPlaceholder] = []
        self.parts: list[Pickled | None] = []

    def leaf(self, value: Any) -> Any:
        """A leaf outside the parts pickled whole."""
        holder = self.leaf_in_part(value)
        if holder is not value:
            self.loose.append(holder)
        return holder

    def leaf_in_part(self, value: Any) -> Any:
        if type(value) not in PLAIN_TENSOR_TYPES:
            return value
        self.tensors.append(value)
        return TensorPlaceholder.of(value)

    def whole(self, container: Any) -> Pickled | None:
        size = constant_size(container, self.sizes)
        if size is None:
            return None
        part = None
        if not (self.shared and _holds_any(container, self.shared)):
            part = Pickled(rebuild(container, self.leaf_in_part, _no_part, {}), size)
        self.parts.append(part)
        return part


class _Replay:
    """A rebuilt header's build: the kept placeholders and parts, in order (``loose`` and
    ``parts``: how many of each it took)."""

    def __init__(self, kept: _Planned) -> None:
        self.kept = kept
        self.sizes: dict[int, int | None] = {}
        self.loose = 0
        self.parts = 0

    def leaf(self, value: Any) -> Any:
        if type(value) not in PLAIN_TENSOR_TYPES:
            return value
        if self.loose == len(self.kept.loose):
            raise _Mismatch
        self.loose += 1
        return self.kept.loose[self.loose - 1]

    def whole(self, container: Any) -> Pickled | None:
        size = constant_size(container, self.sizes)
        if size is None:
            return None
        if self.parts == len(self.kept.parts):
            raise _Mismatch
        part = self.kept.parts[self.parts]
        self.parts += 1
        if part is not None and part.size != size:
            raise _Mismatch
        return part


def _no_part(container: Any) -> None:
    return None


def constant_size(obj: Any, sizes: dict[int, int | None]) -> int | None:
    """How many plain tensors ``obj`` holds if it is a non-empty ``dict``, ``OrderedDict``,
    ``list`` or ``tuple`` whose every value is a plain tensor or such a container; None
    otherwise. ``sizes`` memoizes it by object for one build."""
    kind = type(obj)
    if kind not in _CONTAINERS:
        return None
    key = id(obj)
    if key in sizes:
        return sizes[key]
    values = list(obj.values()) if kind is dict or kind is OrderedDict else obj
    kinds = set(map(type, values))
    size: int | None = None
    if not values or not kinds <= PLAIN_TENSOR_TYPES | _CONTAINERS:
        pass
    elif kinds <= PLAIN_TENSOR_TYPES:
        size = len(values)
    else:
        size = 0
        for value in values:
            inner = 1 if type(value) in PLAIN_TENSOR_TYPES else constant_size(value, sizes)
            if inner is None:
                size = None
                break
            size += inner
    sizes[key] = size
    return size


def rebuild(
    obj: Any,
    leaf: Callable[[Any], Any],
    whole: Callable[[Any], Any],
    memo: dict[int, Any],
) -> Any:
    """``obj``'s nested dicts, lists and tuples rebuilt beside it, as ``pop_tensors``
    leaves them and a header pickles them: a container for which ``whole`` returns
    something other than None is replaced by that, every other leaf by ``leaf(value)``.
    Dicts and lists shared by identity stay shared (``memo``), tuples are rebuilt at each
    visit."""
    kind = type(obj)
    if kind is dict or kind is OrderedDict or kind is list:
        known = memo.get(id(obj))
        if known is not None:
            return known
        out: Any = whole(obj)
        if out is None and kind is list:
            out = [rebuild(value, leaf, whole, memo) for value in obj]
        elif out is None:
            out = kind((key, rebuild(value, leaf, whole, memo)) for key, value in obj.items())
            if kind is OrderedDict:
                out.__dict__.update(vars(obj))
        memo[id(obj)] = out
        return out
    if kind is tuple:
        out = whole(obj)
        return tuple(rebuild(v, leaf, whole, memo) for v in obj) if out is None else out
    return leaf(obj)


def _shared(obj: Any, seen: set[int] | None = None, shared: set[int] | None = None) -> set[int]:
    """The ids of the dicts and lists met more than once in ``obj``."""
    seen = set() if seen is None else seen
    shared = set() if shared is None else shared
    kind = type(obj)
    if kind is dict or kind is OrderedDict or kind is list:
        if id(obj) in seen:
            shared.add(id(obj))
            return shared
        seen.add(id(obj))
    if kind is dict or kind is OrderedDict:
        obj = obj.values()
    elif kind is not list and kind is not tuple:
        return shared
    for value in obj:
        _shared(value, seen, shared)
    return shared


def _holds_any(obj: Any, ids: set[int]) -> bool:
    """Whether a container strictly inside ``obj`` is one of ``ids``."""
    values = obj.values() if isinstance(obj, dict) else obj
    return any(type(v) in _CONTAINERS and (id(v) in ids or _holds_any(v, ids)) for v in values)
