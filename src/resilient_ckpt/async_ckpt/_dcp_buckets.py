"""Trainer side of the async DCP write: a plan's items as per-file write buckets
``(path, name, (bytes_data, tensor_data))`` (see :mod:`._dcp_write`), handed to staging as
explicit data (:class:`WritePayload`).

* **What does not depend on the bytes is computed once per plan.** With the plan cache on
  (:mod:`.state_dict_saver`), an unchanged structure reuses the very same, already validated
  plan object. What derives from the plan alone is cached by its identity (a reference is
  kept, so the id cannot be recycled) and the file options (:class:`_Skeleton`): the split
  into files (:func:`plan_files`) and the tensor items *pickled once*, so the request staged
  every save holds one ``bytes`` of items, not thousands of write items.
* **Staging takes a skeleton and a flat list of tensors.** The payload is not pickled: it
  hands staging (:class:`._staging.StagingSource`) the files' names and bytes items, the
  pickled items, and the source tensors in item order, keyed by the per-plan skeleton; the
  worker pairs them again into plain buckets (:func:`rebuild_buckets`). The skeleton is the
  answer to "same as the last save?": while it is the same, the staging cache re-checks only
  where the tensors' bytes lie (:meth:`._structure.StageCache.hit`).
* **The writer owns what it writes.** Read in the trainer (NVRx's readers, ``preload_fn``,
  a fork or ``execute_sync``), the buckets hold a *new* detached tensor per item, so their
  tensors die with the write (NVRx's tests hold weak references to them); staging reads the
  sources, so those objects are made only if the buckets are read. A CPU view into a larger
  storage is cloned (staging would otherwise copy the whole base).
* **Resolving is a lookup, done at staging.** For a :class:`DefaultSavePlanner` an item is a
  lookup in the planner's flat state (its generic ``resolve_data`` builds index objects per
  item; DTensor's ``to_local`` goes through autograd). A plan of only plain tensors, or only
  Shard/Replicate DTensors over them, is resolved by C-level ``map`` passes; any other mix
  item by item. The lookups run when the request is staged, off the trainer's thread when
  staging is overlapped. Other planners' ``resolve_data`` runs in the save call.
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
from typing import Any, cast

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType

from .. import _dist
from .._torch_compat import DTensor, Replicate, Shard
from .._unpicklable import describe_unpicklable
from ..errors import CheckpointingException, ConfigurationError, InvalidRequestError
from ._dcp_write import BytesData, WriteBucket
from ._staging import StagingPart, StagingSource
from ._structure import PLAIN_TENSOR_TYPES

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


def _lookup_few(fqns: tuple[str, ...]) -> Callable[[dict[str, Any]], tuple]:
    # itemgetter of a single key returns the value itself, not a 1-tuple.
    return lambda flat: tuple(flat[fqn] for fqn in fqns)


class ItemsBlob:
    """Tensor items, with their keys and a C-level lookup of their objects in a flat state."""

    __slots__ = ("fqns", "items", "lookup")

    def __init__(self, items: Sequence[WriteItem]) -> None:
        self.items = tuple(items)
        self.fqns = tuple(item.index.fqn for item in self.items)
        self.lookup: Callable[[dict[str, Any]], tuple] = (
            operator.itemgetter(*self.fqns) if len(self.fqns) > 1 else _lookup_few(self.fqns)
        )


class _Skeleton:
    """Per plan: the files (name, byte items, count of tensor items), every tensor item in
    file order, and those items pickled once (what the worker rebuilds the buckets from)."""

    def __init__(self, items: list[WriteItem], files: list[tuple[str, list[WriteItem]]]) -> None:
        self.items = items  # keeps id(items) from being reused while cached
        self.files: list[tuple[str, list[WriteItem], int]] = []
        tensor_items: list[WriteItem] = []
        for name, file_items in files:
            byte_items = [i for i in file_items if i.type == WriteItemType.BYTE_IO]
            in_file = [i for i in file_items if i.type != WriteItemType.BYTE_IO]
            self.files.append((name, byte_items, len(in_file)))
            tensor_items.extend(in_file)
        self.tensor_items = ItemsBlob(tensor_items)
        self._blob: bytes | None = None
        self._lock = threading.Lock()

    @property
    def blob(self) -> bytes:
        with self._lock:
            if self._blob is None:
                self._blob = pickle.dumps(self.tensor_items.items, protocol=pickle.HIGHEST_PROTOCOL)
            return self._blob


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


# One data file as the worker rebuilds it: (path, name, bytes data, number of tensor items).
FileHeader = tuple[str, str, BytesData, int]


def rebuild_buckets(
    files: list[FileHeader], items: bytes | Sequence[WriteItem], tensors: list[torch.Tensor]
) -> list[WriteBucket]:
    """The plain write buckets of ``files``, their tensor items (``items``, or pickled) paired in
    order with ``tensors``: the worker's side of a :class:`WritePayload`."""
    if isinstance(items, bytes):
        items = cast("Sequence[WriteItem]", pickle.loads(items))
    buckets: list[WriteBucket] = []
    start = 0
    for path, name, bytes_data, count in files:
        end = start + count
        pairs = list(zip(items[start:end], tensors[start:end], strict=True))
        buckets.append((path, name, (bytes_data, pairs)))
        start = end
    return buckets


class WritePayload(StagingSource):
    """One save's write buckets as explicit data: the plan's skeleton (file names, byte items'
    data, tensor items pickled once per plan) and the source tensors in item order.

    Staging takes it as a skeleton and a flat list of tensors (:meth:`staging_part`); the worker
    rebuilds plain ``(path, name, (bytes_data, [(item, tensor), ...]))`` buckets. Read in the
    trainer (:meth:`buckets`: NVRx's readers, ``preload_fn``, a fork or ``execute_sync``) it
    is the same plain list, each tensor a new detached one (so the buckets' tensors die with
    the write; NVRx's tests hold weak references to them), built once.
    """

    def __init__(
        self,
        skeleton: _Skeleton,
        files: list[FileHeader],
        sources: Callable[[], list[torch.Tensor]],
        checked_by_plan: bool,
        quick: Callable[[], list[torch.Tensor] | None] | None = None,
    ) -> None:
        self._quick = quick
        self.skeleton = skeleton
        self.files = files
        self._sources = sources
        self._resolved: list[torch.Tensor] | None = None
        self._buckets: list[WriteBucket] | None = None
        self._checked_by_plan = checked_by_plan
        self._lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        return [name for _, name, _, _ in self.files]

    def sources(self) -> list[torch.Tensor]:
        """The tensors the snapshot copies, in item order (looked up once, at first use)."""
        with self._lock:
            if self._resolved is None:
                self._resolved = self._sources()
            return self._resolved

    def staging_part(self) -> StagingPart:
        quick = self._quick() if self._quick is not None and self._resolved is None else None
        if quick is not None:
            # The raw lookups: a layout equal to a full staging's implies the checks
            # resolve_sources makes (the device is in the plan; a cloned view's storage is
            # the clone's, never the view's), so only a miss needs the checked sources.
            return StagingPart(
                rebuild_buckets,
                (self.files, self.skeleton.blob),
                quick,
                self.skeleton,
                self._checked_by_plan,
                full=self._checked_part,
            )
        return self._checked_part()

    def _checked_part(self) -> StagingPart:
        return StagingPart(
            rebuild_buckets,
            (self.files, self.skeleton.blob),
            self.sources(),
            self.skeleton,
            self._checked_by_plan,
        )

    def buckets(self) -> list[WriteBucket]:
        """The plain buckets, built on first use and kept."""
        if self._buckets is None:
            tensors = list(map(torch.Tensor.detach, self.sources()))
            self._buckets = rebuild_buckets(self.files, self.skeleton.tensor_items.items, tensors)
        return self._buckets

    def __reduce__(self) -> Any:
        return list, (self.buckets(),)


def buckets_of(payload: Any) -> list[WriteBucket]:
    """``payload``'s plain buckets: a :class:`WritePayload`'s, or ``payload`` itself."""
    return payload.buckets() if isinstance(payload, WritePayload) else payload


def file_names(payload: Any) -> list[str]:
    """The data files of ``payload`` (a :class:`WritePayload` or plain buckets)."""
    if isinstance(payload, WritePayload):
        return payload.names
    return [name for _, name, _ in buckets_of(payload)]


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


def _checked_sources(blob: ItemsBlob, planner: SavePlanner, flat: dict[str, Any] | None) -> list:
    try:
        return resolve_sources(blob, planner, flat)
    except CheckpointingException:
        raise
    except Exception as exc:  # the planner's resolve_data
        raise ConfigurationError(
            f"resolving the save plan's tensor items failed: {type(exc).__name__}: {exc}"
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
) -> WritePayload:
    """``plan``'s per-file write buckets as a :class:`WritePayload`: the bytes items resolved now;
    the tensors looked up when first needed (when the request is staged, on the staging thread
    when overlapped) if the planner's resolving is a lookup in its flat state, else now."""
    skeleton = _skeleton(plan, prefix, (thread_count, single_file_per_rank, separation_hint))
    flat = direct_lookup(planner)
    files: list[FileHeader] = []
    for name, byte_items, count in skeleton.files:
        bytes_data: Any = [(item, resolve_bytes(planner, item, flat)) for item in byte_items]
        files.append((join(checkpoint_dir, name), name, bytes_data, count))
    resolve = functools.partial(_checked_sources, skeleton.tensor_items, planner, flat)
    if flat is None:  # the planner's own resolve_data runs now, on the calling thread
        return WritePayload(skeleton, files, functools.partial(_given, resolve()), False)
    quick = functools.partial(_raw_lookups, skeleton.tensor_items, flat)
    return WritePayload(skeleton, files, resolve, True, quick)


def _raw_lookups(blob: ItemsBlob, flat: dict[str, Any]) -> list[torch.Tensor] | None:
    tensors = _uniform_tensors(blob, flat)
    return None if tensors is None else list(tensors)


def _given(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return tensors


def host_buckets(write_buckets: Any, non_blocking: bool = True) -> list[WriteBucket]:
    """The buckets (or a :class:`WritePayload`'s) with every tensor on the host, none aliasing
    memory another process can change (see ``FileSystemWriterAsync.preload_tensors``).
    """
    moved_from_device = False
    result: list[WriteBucket] = []
    for path, name, (bytes_data, tensor_data) in buckets_of(write_buckets):
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
