"""Trainer side of the async DCP write: a plan's items resolved to tensors and grouped into
per-file write buckets ``(path, name, (bytes_data, tensor_data))`` (see :mod:`._dcp_write`).

* **What does not depend on the bytes is computed once per plan.** With the plan cache on
  (:mod:`.state_dict_saver`), an unchanged structure reuses the very same, already validated
  plan object. What derives from the plan alone is cached by its identity (a reference is
  kept, so the id cannot be recycled) and the file options: the split into files
  (:func:`plan_files`) and each file's tensor items *pickled once*, so the request staged
  every save holds one ``bytes`` per file, not thousands of write items.
* **The writer owns what it writes.** Read as a list, each item resolves to a *new* detached
  tensor, so the buckets' tensors die with the write (NVRx's tests hold weak references to
  them); a CPU view into a larger storage is cloned (staging would otherwise copy the whole
  base). Staging reads the *sources* and describes them as detached (``SourcedBatch``), so
  the detached objects are made only if a bucket is read as a list.
* **Resolving is a lookup, done at staging.** For a :class:`DefaultSavePlanner` an item is a
  lookup in the planner's flat state (its generic ``resolve_data`` builds index objects per
  item; DTensor's ``to_local`` goes through autograd). A file of only plain tensors, or only
  Shard/Replicate DTensors over them, is resolved by C-level ``map`` passes; any other mix
  item by item. The lookups run when the request is staged (:class:`ItemTensors`), off the
  trainer's thread when staging is overlapped. Other planners' ``resolve_data`` runs in the
  save call.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import operator
import pickle
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType

from .. import _dist
from .._torch_compat import DTensor, Replicate, Shard
from .._unpicklable import describe_unpicklable
from ..errors import CheckpointingException, ConfigurationError, InvalidRequestError
from ._dcp_write import WriteBucket
from ._staging import PLAIN_TENSOR_TYPES, SourcedBatch, TensorBatch

_CACHE_SIZE = 4


def item_nbytes(item: WriteItem) -> int:
    """Bytes of a tensor item's chunk (0 for byte items, whose size is unknown up front)."""
    if item.tensor_data is None:
        return 0
    numel = math.prod(item.tensor_data.chunk.sizes)
    return numel * item.tensor_data.properties.dtype.itemsize


def split_balanced(items: Sequence[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Deal items into ``bins`` lists: byte items round-robin, tensors largest-first to the
    lightest bin. With one bin the plan order is kept (byte-identical to torch's writer)."""
    if bins <= 1:
        return [list(items)]
    buckets: list[list[WriteItem]] = [[] for _ in range(bins)]
    byte_items = [i for i in items if i.type == WriteItemType.BYTE_IO]
    for k, item in enumerate(byte_items):
        buckets[k % bins].append(item)
    tensor_items = [i for i in items if i.type != WriteItemType.BYTE_IO]
    heap = [(0, b) for b in range(bins)]
    for item in sorted(tensor_items, key=item_nbytes, reverse=True):
        load, b = heapq.heappop(heap)
        buckets[b].append(item)
        heapq.heappush(heap, (load + item_nbytes(item), b))
    return buckets


def plan_files(
    items: Sequence[WriteItem],
    *,
    prefix: str,
    thread_count: int,
    single_file_per_rank: bool,
    separation_hint: str | None,
) -> list[tuple[str, list[WriteItem]]]:
    """``(file name, items)`` for each data file of one rank, numbered as torch numbers them.
    Items whose key starts with ``separation_hint`` go to their own files, prefixed by the hint.
    """
    if separation_hint is None:
        groups = [("", list(items))]
        bins = thread_count
    else:
        hinted = [i for i in items if i.index.fqn.startswith(separation_hint)]
        rest = [i for i in items if not i.index.fqn.startswith(separation_hint)]
        groups = [("", rest), (separation_hint, hinted)]
        bins = max(1, thread_count // 2)
    files: list[tuple[str, list[WriteItem]]] = []
    for group_prefix, group_items in groups:
        if single_file_per_rank:
            chunks = split_balanced(group_items, bins)
        else:
            chunks = [[item] for item in group_items]
        for chunk in chunks:
            if chunk:
                files.append((f"{group_prefix}{prefix}{len(files)}{DEFAULT_SUFFIX}", chunk))
    return files


# -- resolving items to the tensors a snapshot copies ---------------------------------------


_DTENSOR_ONLY = frozenset({DTensor})
_NOT_PARTIAL = frozenset({Shard, Replicate})
_LOCAL_TENSOR = operator.attrgetter("_local_tensor")
_PLACEMENTS = operator.attrgetter("_spec.placements")
_IS_CPU = operator.attrgetter("is_cpu")
_NBYTES = operator.attrgetter("nbytes")


def snapshot_source(tensor: Any, fqn: str) -> torch.Tensor:
    """What a snapshot of ``tensor`` copies from: ``tensor``, or a clone of a CPU view whose
    storage is larger than its bytes.
    """
    if not isinstance(tensor, torch.Tensor):
        raise ConfigurationError(
            f"the planner resolved tensor item {fqn!r} to a {type(tensor).__name__}"
        )
    if tensor.device.type == "cpu":
        if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
            return tensor.detach().clone()
    return tensor


def direct_lookup(planner: SavePlanner) -> dict[str, Any] | None:
    """The planner's flat state when resolving a tensor item is a plain lookup in it."""
    cls = type(planner)
    if not isinstance(planner, DefaultSavePlanner) or any(
        getattr(cls, name) is not getattr(DefaultSavePlanner, name)
        for name in ("resolve_data", "lookup_object", "transform_object")
    ):
        return None
    state = getattr(planner, "state_dict", None)
    return state if isinstance(state, dict) else None


def resolve_blob(blob: ItemsBlob, planner: SavePlanner, flat: dict[str, Any] | None) -> list:
    """A new detached tensor per item of ``blob``."""
    return list(map(torch.Tensor.detach, resolve_sources(blob, planner, flat)))


def resolve_sources(blob: ItemsBlob, planner: SavePlanner, flat: dict[str, Any] | None) -> list:
    """``snapshot_source`` of each of ``blob``'s items; ``flat`` (:func:`direct_lookup`) lets plain
    tensors and non-partial DTensors be looked up directly.
    """
    if flat is None:
        return [snapshot_source(planner.resolve_data(i), i.index.fqn) for i in blob.items]
    tensors = _uniform_tensors(blob, flat)
    if tensors is not None and _plain_cpu(tensors):
        return list(tensors)
    out: list[torch.Tensor] = []
    for item, fqn in zip(blob.items, blob.fqns, strict=True):
        obj: Any = flat.get(fqn)
        kind = type(obj)
        tensor: Any = None
        if kind in PLAIN_TENSOR_TYPES:
            tensor = obj
        elif kind is DTensor and type(local := obj._local_tensor) is torch.Tensor:
            if not any(p.is_partial() for p in obj._spec.placements):
                tensor = local
        out.append(snapshot_source(planner.resolve_data(item) if tensor is None else tensor, fqn))
    return out


def quick_sources(blob: ItemsBlob, flat: dict[str, Any]) -> list | None:
    """:func:`resolve_sources` without per-tensor checks, for the staging cache's optimistic pickle
    (``SourcedBatch``); None unless every item is looked up directly.

    The checks skipped are implied by layouts equal to a full staging's: the layout holds the
    device, and a cloned view's key holds the clone's storage, never equal to the view's.
    """
    tensors = _uniform_tensors(blob, flat)
    return None if tensors is None else list(tensors)


def _uniform_tensors(blob: ItemsBlob, flat: dict[str, Any]) -> tuple | None:
    """The items' tensors by C-level passes when every item is a plain tensor, or every one a
    non-partial DTensor over one; else None (resolved per item).
    """
    try:
        objs = blob.lookup(flat)
    except KeyError:
        return None
    kinds = set(map(type, objs))
    if kinds <= PLAIN_TENSOR_TYPES:
        return objs
    if kinds != _DTENSOR_ONLY:
        return None
    placement_kinds = set(map(type, itertools.chain.from_iterable(map(_PLACEMENTS, objs))))
    if not placement_kinds <= _NOT_PARTIAL:
        return None
    tensors = tuple(map(_LOCAL_TENSOR, objs))
    if set(map(type, tensors)) - {torch.Tensor}:
        return None
    return tensors


def _plain_cpu(tensors: tuple) -> bool:
    """Every tensor on the CPU, none a view into a larger storage."""
    if not all(map(_IS_CPU, tensors)):
        return False
    storage_bytes = map(torch.UntypedStorage.nbytes, map(torch.Tensor.untyped_storage, tensors))
    return not any(map(operator.ne, storage_bytes, map(_NBYTES, tensors)))


# -- the cached skeleton of a plan's buckets -------------------------------------------------


def _load_items(payload: bytes) -> tuple[WriteItem, ...]:
    return pickle.loads(payload)


def _lookup_few(fqns: tuple[str, ...]) -> Callable[[dict[str, Any]], tuple]:
    # itemgetter of a single key returns the value itself, not a 1-tuple.
    return lambda flat: tuple(flat[fqn] for fqn in fqns)


class ItemsBlob:
    """The tensor items of one data file, pickled once (lazily) and reused every save."""

    __slots__ = ("_lock", "_payload", "fqns", "items", "lookup")

    def __init__(self, items: Sequence[WriteItem]) -> None:
        self.items = tuple(items)
        self.fqns = tuple(item.index.fqn for item in self.items)
        # The items' objects in a flat state, as a tuple, by C-level lookups.
        self.lookup: Callable[[dict[str, Any]], tuple] = (
            operator.itemgetter(*self.fqns) if len(self.fqns) > 1 else _lookup_few(self.fqns)
        )
        self._payload: bytes | None = None
        self._lock = threading.Lock()

    def __reduce__(self) -> Any:
        with self._lock:
            if self._payload is None:
                self._payload = pickle.dumps(self.items, protocol=pickle.HIGHEST_PROTOCOL)
        return _load_items, (self._payload,)


def _pairs(items: tuple[WriteItem, ...], tensors: list[torch.Tensor]) -> list:
    return list(zip(items, tensors, strict=True))


class ItemTensors(list[tuple[WriteItem, torch.Tensor]]):
    """A bucket's ``(WriteItem, tensor)`` pairs, a plain list to every reader, that pickle as one
    blob plus the tensors.

    With a ``resolver`` the tensors are looked up on first list use; pickled before that, they
    are found by the pickler and staged as their detached views (a ``SourcedBatch``), on the
    staging thread when overlapped. Only lookups into the plan's own flat state are deferred
    (:func:`build_buckets`).
    """

    blob: ItemsBlob
    _resolver: _Resolver | None = None
    _lock: threading.Lock

    @classmethod
    def deferred(cls, blob: ItemsBlob, resolver: _Resolver) -> ItemTensors:
        made = cls()
        made.blob = blob
        made._resolver = resolver
        made._lock = threading.Lock()
        return made

    def _materialize(self) -> None:
        if self._resolver is None:
            return
        with self._lock:
            resolver = self._resolver
            if resolver is None:
                return
            tensors = list(map(torch.Tensor.detach, resolver.checked()))
            list.extend(self, zip(self.blob.items, tensors, strict=True))
            self._resolver = None

    def __reduce_ex__(self, protocol: Any) -> Any:
        resolver = self._resolver
        if resolver is not None:
            return _pairs, (self.blob, SourcedBatch(resolver.checked, resolver.quick))
        return _pairs, (self.blob, TensorBatch(tensor for _, tensor in self))


class _Resolver:
    """How a deferred bucket finds its tensors in the planner's flat state."""

    __slots__ = ("blob", "flat", "planner")

    def __init__(self, blob: ItemsBlob, planner: SavePlanner, flat: dict[str, Any]) -> None:
        self.blob, self.planner, self.flat = blob, planner, flat

    def checked(self) -> list[torch.Tensor]:
        try:
            return resolve_sources(self.blob, self.planner, self.flat)
        except CheckpointingException:
            raise
        except Exception as exc:  # the planner's resolve_data, running late
            raise ConfigurationError(
                f"resolving the save plan's tensor items failed: {type(exc).__name__}: {exc}"
            ) from exc

    def quick(self) -> list[torch.Tensor] | None:
        return quick_sources(self.blob, self.flat)


# Every list operation sees the resolved pairs (pickling has its own __reduce_ex__).
_RESOLVING = (
    "__len__", "__getitem__", "__iter__", "__reversed__", "__contains__", "__eq__", "__ne__",
    "__lt__", "__le__", "__gt__", "__ge__", "__repr__", "__add__", "__mul__", "__rmul__",
    "__iadd__", "__imul__", "__setitem__", "__delitem__", "append", "extend", "insert", "pop",
    "remove", "clear", "index", "count", "copy", "sort", "reverse",
)  # fmt: skip


def _resolving_first(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(self: ItemTensors, *args: Any, **kwargs: Any) -> Any:
        self._materialize()
        return method(self, *args, **kwargs)

    return wrapper


for _name in _RESOLVING:
    setattr(ItemTensors, _name, _resolving_first(getattr(list, _name)))


class _Skeleton:
    """Per plan: the files, each with its byte items, tensor items and their blob."""

    def __init__(self, items: list[WriteItem], files: list[tuple[str, list[WriteItem]]]) -> None:
        self.items = items  # keeps id(items) from being reused while cached
        self.files = []
        for name, file_items in files:
            byte_items = [i for i in file_items if i.type == WriteItemType.BYTE_IO]
            tensor_items = [i for i in file_items if i.type != WriteItemType.BYTE_IO]
            self.files.append((name, byte_items, ItemsBlob(tensor_items)))


_skeletons: OrderedDict[tuple, _Skeleton] = OrderedDict()
_skeletons_lock = threading.Lock()


def _skeleton(plan: SavePlan, prefix: str, options: tuple) -> _Skeleton:
    key = (id(plan.items), prefix, *options)
    with _skeletons_lock:
        found = _skeletons.get(key)
        if found is not None and found.items is plan.items:
            _skeletons.move_to_end(key)
            return found
    thread_count, single_file_per_rank, separation_hint = options
    files = plan_files(
        plan.items,
        prefix=prefix,
        thread_count=thread_count,
        single_file_per_rank=single_file_per_rank,
        separation_hint=separation_hint,
    )
    made = _Skeleton(plan.items, files)
    with _skeletons_lock:
        _skeletons[key] = made
        while len(_skeletons) > _CACHE_SIZE:
            _skeletons.popitem(last=False)
    return made


def resolve_bytes(planner: SavePlanner, item: WriteItem, flat: dict[str, Any] | None) -> Any:
    """A bytes item's data (the planner pickles its value); a value that cannot be pickled
    is an :class:`InvalidRequestError` naming its key, the path inside it and the type."""
    try:
        return planner.resolve_data(item)
    except CheckpointingException:
        raise
    except Exception as exc:
        fqn = item.index.fqn
        state = flat if flat is not None else getattr(planner, "state_dict", None)
        value = state.get(fqn) if isinstance(state, dict) else None
        where = describe_unpicklable(value, f"state[{fqn!r}]") if value is not None else None
        raise InvalidRequestError(
            f"rank {_dist.rank()}: {where or f'the value at key {fqn!r}'} cannot be saved: "
            f"{type(exc).__name__}: {exc}. "
            "Every value that is not a tensor must be picklable (no lambdas, open files, "
            "locks or process groups)"
        ) from exc


def build_buckets(
    plan: SavePlan,
    planner: SavePlanner,
    *,
    prefix: str,
    join: Any,
    checkpoint_dir: str,
    thread_count: int,
    single_file_per_rank: bool,
    separation_hint: str | None,
) -> list[WriteBucket]:
    """Resolve ``plan``'s items to data and group them into per-file write buckets."""
    skeleton = _skeleton(plan, prefix, (thread_count, single_file_per_rank, separation_hint))
    flat = direct_lookup(planner)
    buckets: list[WriteBucket] = []
    for name, byte_items, blob in skeleton.files:
        bytes_data: Any = [(item, resolve_bytes(planner, item, flat)) for item in byte_items]
        if flat is not None:
            # Lookups in the plan's flat state only (a DefaultSavePlanner's): deferred.
            tensor_data = ItemTensors.deferred(blob, _Resolver(blob, planner, flat))
        else:  # the planner's own resolve_data runs now, on the calling thread
            tensor_data = ItemTensors(
                zip(blob.items, resolve_blob(blob, planner, flat), strict=True)
            )
            tensor_data.blob = blob
        buckets.append((join(checkpoint_dir, name), name, (bytes_data, tensor_data)))
    return buckets


def host_buckets(write_buckets: list[WriteBucket], non_blocking: bool = True) -> list[WriteBucket]:
    """The buckets with every tensor on the host, none aliasing memory another process can change
    (see ``FileSystemWriterAsync.preload_tensors``).
    """
    moved_from_device = False
    result: list[WriteBucket] = []
    for path, name, (bytes_data, tensor_data) in write_buckets:
        host = []
        for item, tensor in tensor_data:
            if tensor.device.type != "cpu":
                moved_from_device = True
                tensor = tensor.to("cpu", non_blocking=non_blocking)
            elif tensor.is_shared():
                tensor = tensor.detach().clone()
            host.append((item, tensor))
        result.append((path, name, (bytes_data, host)))
    if moved_from_device and non_blocking and torch.cuda.is_available():
        torch.cuda.synchronize()
    return result
