"""Is this save laid out as the last one? The library's one answer, at two depths.

Decision: a training job saves the same state again and again: the same containers and keys,
tensors of the same shapes and dtypes, mostly in the very same memory. Work that depends only
on that is done at the first save and reused while it holds. Two depths of "the same" exist,
and each is answered here once, for every flow:

* **The structure** (:func:`walk`, :class:`StructureCache`): the containers' types and keys,
  which containers are met twice, each leaf's type, and each tensor's description (type,
  device, layout, dtype, shape, ``requires_grad``, stride, conjugate and negative bits; for a
  DTensor its mesh, placements, global shape and stride). Planning depends on it alone: the
  DCP plan (:mod:`._planning`) and the local shard's header and records
  (:mod:`..local._shard_cache`) are kept in a :class:`StructureCache`, under the key of the
  state they were made for, and dropped at the first save whose key differs. Values are not
  part of the key; the walk returns the plain ones for the flows whose output holds them.
* **The layout** (:class:`StageCache`): the structure of the *request* handed to the worker,
  plus where each tensor's bytes lie (storage address, offset and size). Staging depends on
  it: each tensor's descriptor, which storages share a slot, and the copy ranges. Addresses
  are deliberately not part of the structure: a tensor re-created over new memory keeps the
  plan but not the copy ranges.

**The walk** follows DCP's flattening (``traverse_state_dict``), so that its leaves are the
planner's flat values in order: mappings are walked; a list is walked element by element if
it holds a tensor, a mapping or such a list, and otherwise is one leaf, as a tuple always is.
Lists and tuples are still walked inside (into the key) for the local flow, which pops every
tensor. A state holding what the walk does not model (other tensor subclasses, objects with
``__create_write_items__``, list subclasses) has no structure: its flows plan in full.

**The staging cache.** Staging takes a skeleton and a flat list of tensors
(``_staging``). A save whose list has the previous save's length and, tensor by tensor, the
previous save's description (:class:`TensorCheck`) and place of its bytes
(:func:`storage_layout`) has equal descriptors, equal slot grouping and equal copy ranges, so
the cached copy plan copies exactly the bytes a full staging would. Where an explicit source's
key (the plan cache's entry: a DCP plan's skeleton, a :class:`StructureCache` generation)
vouches for the descriptions, only where the bytes lie and the strides are compared
(:func:`explicit_layout`), once. A steady save's pickle takes every tensor as one to stage:
a tensor that must go by value (sparse, conjugate) is not described as at a full staging,
so that save stages fully. The cache holds no tensor, only the layouts and the plans.
"""

from __future__ import annotations

import itertools
import operator
import pickle
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from .._logging import get_logger
from .._torch_compat import dtensor_specs, is_sharded_tensor, loaded_dtensor, tensor_guard
from ._arena import Arena, ArenaPool
from ._copy import (
    NO_DEVICE,
    DeviceOrder,
    DevicePlan,
    Segment,
    copy_all,
    destinations,
    plan_shares,
    start_copies,
)
from ._protocol import Slot

logger = get_logger(__name__)

# The exact types of the tensors staging describes without any check beyond their layout (no
# subclass with state of its own): what a staging batch may hold, and what the local flow pops.
PLAIN_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})


# -- the tensors' description and layout ----------------------------------------------------

# One C-level call per tensor for the fields that are plain attributes.
_ATTRIBUTES = operator.attrgetter("device", "layout", "dtype", "shape", "requires_grad")


def tensor_meta(tensors: Sequence[torch.Tensor]) -> tuple[list, ...]:
    """Type, device, layout, dtype, shape, ``requires_grad``, stride and the conjugate and
    negative bits of every tensor, as columns (one list per field). Raises for a tensor
    without strides."""
    return (
        list(map(type, tensors)),
        list(map(_ATTRIBUTES, tensors)),
        list(map(torch.Tensor.stride, tensors)),
        list(map(torch.Tensor.is_conj, tensors)),
        list(map(torch.Tensor.is_neg, tensors)),
    )


_LAYOUT = operator.attrgetter("layout")


class TensorCheck:
    """Whether later tensors are described as ``tensors`` were (:func:`tensor_meta`), position
    by position. It holds no tensor.

    Decision: this check runs on every tensor at every steady save of every flow, in the save
    call. It is done by ``torch.compile``'s own C++ tensor guard where that is usable
    (:func:`~.._torch_compat.tensor_guard`), as reading the fields from Python costs several
    times more (docs/performance.md); else the fields are read and compared. Raises
    ``ValueError`` for tensors that are not all strided: states holding such tensors are
    planned in full at every save.
    """

    __slots__ = ("_count", "_guard", "_meta")

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        if not set(map(_LAYOUT, tensors)) <= {torch.strided}:
            raise ValueError("a tensor that is not strided")
        self._count = len(tensors)
        self._guard = tensor_guard(tensors)
        self._meta = tensor_meta(tensors) if self._guard is None else None

    def matches(self, tensors: Sequence[torch.Tensor]) -> bool:
        if len(tensors) != self._count:
            return False
        try:
            if self._guard is not None:
                return bool(self._guard.check(*tensors))
            return tensor_meta(tensors) == self._meta
        except Exception:  # e.g. a sparse tensor: no strides
            return False


def storage_layout(tensors: Sequence[torch.Tensor]) -> tuple[list, ...]:
    """Where the bytes of every tensor lie: storage offset, storage address and storage size,
    as columns. Raises for a tensor without a strided storage."""
    storages = list(map(torch.Tensor.untyped_storage, tensors))
    return (
        list(map(torch.Tensor.storage_offset, tensors)),
        list(map(torch.UntypedStorage.data_ptr, storages)),
        list(map(torch.UntypedStorage.nbytes, storages)),
    )


def explicit_layout(tensors: Sequence[torch.Tensor]) -> tuple[list, ...]:
    """:func:`storage_layout` and each tensor's stride: what an explicit source's staging
    depends on besides what its key vouches for (dtype, shape)."""
    return (*storage_layout(tensors), list(map(torch.Tensor.stride, tensors)))


# -- the structure ----------------------------------------------------------------------------

# Leaves whose pickle depends on their value alone, compared exactly (see _exact).
_SCALARS = frozenset({int, float, str, bytes, bool, type(None)})
_AGAIN = "again"  # the token of a container met before in the same walk
_LEAVES = "leaves"  # the token of a mapping of leaves walked at once (see _Walk.mapping)


@dataclass(frozen=True, slots=True)
class Structure:
    """One walk of a nested state (see the module docstring).

    ``key``: what planning depends on; equal keys, equal plans. ``leaves``: DCP's flat
    values, in its order. ``tensors``: the plain tensors, in the order ``pop_tensors``
    meets them. ``values``: the exact leaves' values (floats by their bits). ``plain``:
    the state is made of dicts, ``OrderedDict``s, lists and tuples of plain tensors and
    exact leaves alone (what the local flow's header cache models).
    """

    key: tuple
    leaves: list
    tensors: list
    values: list
    plain: bool


class _Walk:
    __slots__ = (
        "dtensor",
        "dtensors",
        "leaves",
        "others",
        "plain",
        "seen",
        "tensors",
        "tokens",
        "uniform",
        "values",
    )

    def __init__(self) -> None:
        self.dtensor = loaded_dtensor()
        self.uniform = _UNIFORM if self.dtensor is None else _UNIFORM | {self.dtensor}
        self.tokens: list = []
        self.leaves: list = []
        self.tensors: list = []
        self.dtensors: list = []
        self.others: list = []
        self.values: list = []
        self.seen: dict[int, int] = {}
        self.plain = True

    def again(self, obj: Any) -> None:
        """Mark a container met before: a pickle keeps the sharing, so it is structure."""
        count = len(self.seen)
        first = self.seen.setdefault(id(obj), count)
        if first != count:
            self.tokens.append((_AGAIN, first))

    def mapping(self, obj: Mapping) -> None:
        kind = type(obj)
        self.again(obj)
        if kind is OrderedDict:  # a module's state_dict(): ``_metadata`` pickles with it
            self.tokens.append((kind, tuple(obj), _attributes(obj)))
        else:
            self.tokens.append((kind, tuple(obj)))
            self.plain = self.plain and kind is dict
        items = list(obj.values())
        kinds = list(map(type, items))
        distinct = set(kinds)
        tensor_kinds = distinct - _SCALARS
        if not tensor_kinds or (len(tensor_kinds) == 1 and tensor_kinds <= self.uniform):
            # Leaves only, tensors of one type at most (a model's parameters, an optimizer's
            # per-parameter state): C-level passes instead of a call per value.
            self.tokens.append((_LEAVES, tuple(kinds)))
            self.leaves.extend(items)
            if len(distinct) == 1 and tensor_kinds:
                tensors = items
            else:
                scalars = itertools.compress(items, map(_SCALARS.__contains__, kinds))
                self.values.extend(map(_exact, scalars))
                tensors = list(itertools.compress(items, map(tensor_kinds.__contains__, kinds)))
            if self.dtensor in tensor_kinds:
                self.dtensors.extend(tensors)
                self.plain = False
            else:
                self.tensors.extend(tensors)
            return
        for item in items:
            self.value(item)

    def sequence(self, obj: list | tuple) -> bool:
        """Walk a list or tuple; whether DCP walks it element by element."""
        kind = type(obj)
        if kind is not tuple:
            self.again(obj)
            self.plain = self.plain and kind is list
        self.tokens.append((kind, len(obj)))
        mark = len(self.leaves)
        walked = False
        for item in obj:
            walked = self.value(item) or walked
        if kind is tuple or not walked:  # DCP keeps it whole, as one leaf
            del self.leaves[mark:]
            self.leaves.append(obj)
            return False
        return True

    def value(self, obj: Any) -> bool:
        """Walk one value; whether it makes a list holding it walked by DCP."""
        kind = type(obj)
        if kind in PLAIN_TENSOR_TYPES or kind is self.dtensor:
            self.tokens.append(kind)
            self.leaves.append(obj)
            if kind is self.dtensor:
                self.dtensors.append(obj)
                self.plain = False
            else:
                self.tensors.append(obj)
            return True
        if isinstance(obj, Mapping):
            self.mapping(obj)
            return True
        if kind is tuple or isinstance(obj, list):
            return self.sequence(obj)
        if isinstance(obj, torch.Tensor) or hasattr(obj, "__create_write_items__"):
            # A ShardedTensor, another tensor subclass, an object that makes its own DCP
            # write items: described one by one (:func:`_describe`).
            self.tokens.append(kind)
            self.leaves.append(obj)
            self.others.append(obj)
            self.plain = False
            return isinstance(obj, torch.Tensor)
        self.tokens.append(kind)
        self.leaves.append(obj)
        if kind in _SCALARS:
            self.values.append(_exact(obj))
        else:  # a tuple subclass or any other object: its pickle may not follow equality
            self.plain = False
        return False


# Mappings whose values all have one of these types are walked by C-level passes.
_UNIFORM = PLAIN_TENSOR_TYPES


def _exact(value: Any) -> Any:
    """A plain leaf's value, compared exactly: a float by its bits (``0.0 == -0.0``, but they
    pickle apart)."""
    return value.hex() if type(value) is float else (type(value), value)


def _attributes(obj: Any) -> bytes | None:
    """An object's attributes as a comparable snapshot (their pickle), None if it has none."""
    attrs = vars(obj)
    return pickle.dumps(attrs, protocol=pickle.HIGHEST_PROTOCOL) if attrs else None


def _describe(obj: Any) -> Any:
    """What DCP's write items for ``obj`` (not a plain tensor or a DTensor) depend on."""
    if is_sharded_tensor(obj):  # the whole tensor's shards, and which this rank holds
        return (obj.metadata(), [shard.metadata for shard in obj.local_shards()])
    if hasattr(obj, "__create_write_items__"):
        return obj.__create_write_items__("", obj)
    return (type(obj), obj.shape, obj.dtype, obj.requires_grad, obj.layout)


def walk(state: Mapping) -> Structure | None:
    """The structure of ``state`` (a mapping), or None if it holds what the walk does not
    model (see the module docstring)."""
    if not isinstance(state, Mapping):
        return None
    visit = _Walk()
    try:
        visit.mapping(state)
        dtensors = visit.dtensors
        key = (
            visit.tokens,
            dtensor_specs(dtensors),
            list(map(operator.attrgetter("requires_grad"), dtensors)),
            list(map(_describe, visit.others)),
        )
    except Exception as exc:  # unpicklable attributes, a tensor without strides, ...
        logger.debug("no structure for this state (planned in full): %r", exc)
        return None
    return Structure(key, visit.leaves, visit.tensors, visit.values, visit.plain)


T = TypeVar("T")


# Each remembered planning's number, unique in the process.
_GENERATIONS = itertools.count(1)


class StructureCache(Generic[T]):
    """What one consumer derived from the last structure it planned for: the product, under
    that structure's key and the description of its plain tensors (:class:`TensorCheck`).

    ``lookup`` gives the product if this save's key equals the remembered one and its tensors
    are described as those were, else None; ``remember`` replaces it after a full planning
    (and drops it for tensors that are not all strided); ``clear`` drops it. Any change
    invalidates. ``generation``: the remembered planning's number (None: none), the same
    for every save that reuses it, so that what those saves stage is known to be described
    alike (a :class:`StageCache` key).
    """

    def __init__(self) -> None:
        self._kept: tuple[tuple, TensorCheck, T] | None = None
        self.generation: int | None = None

    def lookup(self, key: tuple | None, tensors: Sequence[torch.Tensor]) -> T | None:
        kept = self._kept
        if key is None or kept is None or key != kept[0] or not kept[1].matches(tensors):
            return None
        return kept[2]

    def remember(self, key: tuple, tensors: Sequence[torch.Tensor], product: T) -> None:
        try:
            self._kept = (key, TensorCheck(tensors), product)
            self.generation = next(_GENERATIONS)
        except Exception as exc:  # not all strided, no strides, ...: never reused
            logger.debug("not kept for reuse: %r", exc)
            self.clear()

    def keep_product(self, product: T) -> None:
        """Replace the product kept under the same key and tensors (after a lookup hit)."""
        if self._kept is not None:
            self._kept = (self._kept[0], self._kept[1], product)

    def clear(self) -> None:
        self._kept = None
        self.generation = None


# -- the staging cache ------------------------------------------------------------------------


class StageCache:
    """One queue's memory of its previous staged request (see the module docstring).

    ``hits`` and ``misses`` count the saves that did and did not reuse it.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._check: TensorCheck | None = None
        self._storage: tuple[list, ...] = ()
        self._descriptors = b""
        self._slots: tuple[Slot, ...] = ()
        self._total = 0
        self._threads = 0
        self._shares: list[list[Segment]] = []
        self._device = NO_DEVICE
        self.hits = 0
        self.misses = 0

    def clear(self) -> None:
        self._key = None
        self._check = None
        self._storage = ()
        self._descriptors = b""
        self._shares = []
        self._device = NO_DEVICE

    def remember(
        self,
        key: tuple,
        checked: bool,
        descriptors: bytes,
        tensors: list[torch.Tensor],
        slots: tuple[Slot, ...],
        host: list[Segment],
        device: DevicePlan,
        total: int,
        threads: int,
        *,
        counted: bool = True,
    ) -> None:
        """After a full staging: keep, under the explicit sources' ``key``, the descriptors and
        copy plan of the request's ``tensors`` (in the staging's order). ``checked``: the key
        vouches for the tensors' descriptions, so only where their bytes lie (and their
        strides) is compared at the next save; else their descriptions too. ``host``: the
        copy ranges with destinations relative to the arena's start. ``counted``: a save
        missed the cache (False for a warm-up, which saves nothing)."""
        self.misses += int(counted)
        self.clear()
        try:
            check = None if checked else TensorCheck(tensors)
            storage = explicit_layout(tensors) if checked else storage_layout(tensors)
        except Exception as exc:  # an exotic tensor: never reuse, stage fully
            logger.debug("staging cache disabled for this request: %r", exc)
            return
        self._key = key
        self._check = check
        self._storage = storage
        self._descriptors = descriptors
        self._slots = slots
        self._total = total
        self._threads = threads
        self._shares = plan_shares(host, threads)
        self._device = device

    def hit(
        self, key: tuple, tensors: list[torch.Tensor], threads: int, checked: bool
    ) -> bytes | None:
        """The cached descriptors if a request whose explicit sources have ``key`` hands
        ``tensors`` laid out as at the previous save (one check of each), else None."""
        if self._key is None or key != self._key or threads != self._threads:
            return None
        check = self._check
        if check is None and not checked:
            return None
        try:
            if check is not None:
                if not check.matches(tensors) or storage_layout(tensors) != self._storage:
                    return None
            elif explicit_layout(tensors) != self._storage:
                return None
        except Exception:  # a tensor without a strided storage: the full path reports it
            return None
        self.hits += 1
        return self._descriptors

    @property
    def kept(self) -> bool:
        """Whether the cache holds a staging to reuse."""
        return self._key is not None

    def planned_for(self, slots: tuple[Slot, ...]) -> bool:
        """Whether the cache holds the copy plan of the staging that laid out ``slots``
        (just remembered)."""
        return self._key is not None and self._slots is slots

    @property
    def slots(self) -> tuple[Slot, ...]:
        return self._slots

    @property
    def total(self) -> int:
        return self._total

    def prepare(self, arena: Arena, tensors: list[torch.Tensor]) -> None:
        """Build in ``arena`` now what a save with the cached plan would build on first use
        of it (the device copies' typed views): the warm-up's part of the first save.
        ``tensors``: those the cache was filled from, in its order."""
        if tensors and self.kept and self._device.slots and arena.nbytes >= self._total:
            destinations(self._device, arena, tensors, keep=True)

    def copy(
        self,
        pool: ArenaPool,
        wait_for_release: Callable[[], bool],
        tensors: list[torch.Tensor],
        *,
        order: DeviceOrder | None = None,
    ) -> Arena:
        """Acquire an arena and copy into it with the cached plan (see ``copy_all``);
        ``tensors``: the request's, in the order the plan indexes them."""
        arena = pool.acquire(self._total, wait_for_release)
        try:
            # The device copies are issued first, to run while the host ranges are copied.
            device_wait = start_copies(self._device, arena, tensors, keep=True, order=order)
            copy_all(
                (),
                threads=self._threads,
                device_wait=device_wait,
                shares=self._shares,
                base=arena.address,
            )
        except BaseException:
            pool.release(arena.arena_id)
            raise
        return arena
