"""Read-once DCP loads: a stored byte range that several ranks need is read by one of them and
carried to the others over the process group; and the count of the bytes each rank read.

With data parallelism every rank of a replica group needs the same items, and torch's reader
has each rank read all of them: a restore reads the checkpoint once per replica from shared
storage while the job waits. Here the reads are planned across ranks inside the two
collectives ``dcp.load`` already makes.

**The plan** (coordinator, ``prepare_global_plan``, which sees every ``LoadPlan``): the unit
of reading is an item's byte range, or a whole file where a rank cannot read part of one
(:meth:`ReadOnceReader._whole_files`). A unit needed by one rank is read by it; a shared unit
by the needer with the fewest bytes so far (largest first, ties to the lowest rank). Each
rank's :class:`ReadOrders` travel in its plan's ``storage_data``, in the scatter
``dcp.load`` makes anyway, not in an extra all-gather whose payload would grow with the job.
Orders are made only when the load spans every rank (the library's group carries the data),
``read_once`` is on (the coordinator decides), some unit is shared, and no item used stream
transforms; otherwise each rank reads all it needs, as torch's reader does.

**The load** (``read_data``, every rank): (1) read this rank's units, for itself and others;
(2) one agreement on the library's gloo group (:func:`~resilient_ckpt._dist.agree`), so a
failed read is known before any data moves and every rank raises
:class:`~resilient_ckpt.errors.RankCheckpointReadError` instead of waiting on a peer that
will never send; (3) one message per pair of ranks, all posted at once
(``batch_isend_irecv``), so no ordering can deadlock; (4) copy into targets as the plain
load does. Stored bytes travel over gloo; when every target is on CUDA and the default group
is NCCL (agreed in step 2), tensor items are decoded by the reader and go over NCCL. A
peer dying mid-transfer is bounded by the group's timeout.

:class:`ReadCounter` counts bytes read from storage where the reading happens, not bytes
received from peers nor the metadata; :func:`bytes_read_by_rank` gathers every rank's.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .. import _dist, _telemetry
from .._logging import get_logger
from .._torch_compat import has_stream_transforms
from ..config import read_once_enabled
from ..errors import CheckpointReadError, CorruptCheckpointError
from ._dcp_items import item_piece, item_tensor, load_item

__all__ = ["ReadCounter", "ReadOnceReader", "ReadOrders", "bytes_read_by_rank", "plan_reads"]

logger = get_logger(__name__)

# Tensor items in an NCCL message start on this boundary, so each can be viewed as its dtype.
_ALIGN = 64

Items = tuple[MetadataIndex, ...]


class ReadCounter:
    """Bytes read from storage by this rank in a load (thread-safe: downloads run on threads)."""

    def __init__(self) -> None:
        self._bytes = 0
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        with self._lock:
            self._bytes += int(nbytes)

    def reset(self) -> None:
        with self._lock:
            self._bytes = 0

    @property
    def bytes(self) -> int:
        return self._bytes


def bytes_read_by_rank(reader: Any) -> list[int]:
    """Every rank's ``reader.bytes_read`` for its latest load, in rank order. Collective on the
    library's group; without a process group, this process's count alone.
    """
    counts = _dist.agree("gathering bytes read", None, ints=(int(reader.bytes_read),))
    return [outcome.ints[0] for outcome in counts]


@dataclass(frozen=True)
class ReadOrders:
    """One rank's part in a read-once load: per receiving rank the items this rank reads and sends
    it, and per sending rank the items that arrive from it, in the sender's order.
    """

    sends: tuple[tuple[int, Items], ...] = ()
    receives: tuple[tuple[int, Items], ...] = ()


def plan_reads(
    needs: Sequence[Sequence[MetadataIndex]],
    unit_of: Callable[[MetadataIndex], tuple[Hashable, int]],
) -> list[ReadOrders] | None:
    """Every rank's :class:`ReadOrders` from ``needs[rank]`` (its plan's storage items);
    ``unit_of(item)`` gives the unit read to get the item and its size. None when no unit is
    shared. Deterministic.
    """
    units: dict[MetadataIndex, Hashable] = {}
    needers: dict[Hashable, list[int]] = {}
    sizes: dict[Hashable, int] = {}
    wanted = [list(dict.fromkeys(items)) for items in needs]
    for rank, items in enumerate(wanted):
        for index in items:
            if index not in units:
                units[index], size = unit_of(index)
                sizes[units[index]] = size
            ranks = needers.setdefault(units[index], [])
            if not ranks or ranks[-1] != rank:
                ranks.append(rank)
    load = [0] * len(wanted)
    shared = []
    for position, (unit, ranks) in enumerate(needers.items()):
        if len(ranks) == 1:
            load[ranks[0]] += sizes[unit]
        else:
            shared.append((-sizes[unit], position, unit))
    if not shared:
        return None
    reader: dict[Hashable, int] = {}
    for _, _, unit in sorted(shared, key=lambda entry: entry[:2]):
        chosen = min(needers[unit], key=lambda r: (load[r], r))
        reader[unit] = chosen
        load[chosen] += sizes[unit]
    return _orders(wanted, units, reader)


def _orders(
    wanted: list[list[MetadataIndex]],
    units: dict[MetadataIndex, Hashable],
    reader: dict[Hashable, int],
) -> list[ReadOrders]:
    pairs: dict[tuple[int, int], list[MetadataIndex]] = {}
    for rank, items in enumerate(wanted):
        for index in items:
            source = reader.get(units[index], rank)
            if source != rank:
                pairs.setdefault((source, rank), []).append(index)
    # A sender's identical lists are one object, so its plan pickles the list once; a
    # receiver's list holds its own plan's items, which its plan pickles anyway.
    interned: dict[Items, Items] = {}
    sends: list[list[tuple[int, Items]]] = [[] for _ in wanted]
    receives: list[list[tuple[int, Items]]] = [[] for _ in wanted]
    for (source, target), items in sorted(pairs.items()):
        mine = tuple(items)
        sends[source].append((target, interned.setdefault(mine, mine)))
        receives[target].append((source, mine))
    return [ReadOrders(tuple(s), tuple(r)) for s, r in zip(sends, receives, strict=True)]


class ReadOnceReader:
    """Read-once loading for a ``FileSystemReader`` subclass (mixed in before it).

    ``read_once``: None follows ``RESILIENT_CKPT_READ_ONCE`` (default on); False reads as torch's
    reader does. Call protocol (``dcp.load``'s): ``set_up_storage_reader`` on every rank (resets
    the count), ``prepare_global_plan`` on the coordinator (plans the reads), ``read_data`` on
    every rank, collective on the library's group when the plan carries orders. Subclasses
    implement ``_read_alone`` and ``_file_bytes``, and may override ``_whole_files``,
    ``_begin_reads`` and ``_release_files``.
    """

    storage_data: dict[Any, Any]
    # The flow its restores are reported as (:mod:`.._telemetry`); None: its caller reports.
    telemetry_flow: str | None = "dcp"

    def __init__(self, *args: Any, read_once: bool | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read_once = read_once_enabled() if read_once is None else bool(read_once)
        self._read_counter = ReadCounter()
        self._read_metadata: Metadata | None = None

    @property
    def bytes_read(self) -> int:
        """Data bytes this rank read from storage in its latest load (not those received from peers,
        nor the metadata).
        """
        return self._read_counter.bytes

    # -- the StorageReader calls --------------------------------------------------------------

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)  # type: ignore[misc]
        self._read_metadata = metadata
        self._read_counter.reset()

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        plans = super().prepare_global_plan(plans)  # type: ignore[misc]
        if not self.read_once or len(plans) < 2 or len(plans) != _dist.world_size():
            return plans
        if any(has_stream_transforms(self.storage_data, plan.items) for plan in plans):
            return plans
        orders = plan_reads(
            [[item.storage_index for item in plan.items] for plan in plans], self._units()
        )
        if orders is None:
            return plans
        return [dataclasses.replace(p, storage_data=o) for p, o in zip(plans, orders, strict=True)]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        orders = plan.storage_data
        started = time.perf_counter()
        if not isinstance(orders, ReadOrders):
            read = self._read_alone(plan, planner)
            self._report_restore(started, read_once=False)
            return read
        try:
            _Load(self, plan, planner, orders).run()
        finally:
            self._release_files()
        self._report_restore(started, read_once=True)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _report_restore(self, started: float, read_once: bool) -> None:
        if self.telemetry_flow is not None:
            seconds = time.perf_counter() - started
            _telemetry.restore_done(
                self.telemetry_flow,
                self.bytes_read,
                seconds,
                **{"resilient_ckpt.read_once": read_once},
            )

    # -- hooks ----------------------------------------------------------------------------------

    def _read_alone(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """``read_data`` without orders: this rank reads all its plan needs."""
        raise NotImplementedError

    def _file_bytes(self, name: str) -> torch.Tensor:
        """Data file ``name``'s bytes as a uint8 CPU tensor; a whole-file reader counts them
        here.
        """
        raise NotImplementedError

    def _whole_files(self) -> bool:
        """Whether reading any item of a file reads the whole file."""
        return False

    def _begin_reads(self, names: list[str]) -> None:
        """The files this rank is about to read, in order (a chance to start downloads)."""

    def _release_files(self) -> None:
        """The load is over: drop the files' bytes."""

    # -- helpers --------------------------------------------------------------------------------

    def _count_read(self, nbytes: int) -> None:
        self._read_counter.add(nbytes)

    def _units(self) -> Callable[[MetadataIndex], tuple[Hashable, int]]:
        """The unit a rank reads to get an item, and its size."""
        data = self.storage_data
        if not self._whole_files():
            return lambda index: (
                (data[index].relative_path, data[index].offset, data[index].length),
                data[index].length,
            )
        extents: dict[str, int] = {}  # a file's size as the metadata knows it: its last item's end
        for info in data.values():
            end = info.offset + info.length
            extents[info.relative_path] = max(extents.get(info.relative_path, 0), end)
        return lambda index: (data[index].relative_path, extents[data[index].relative_path])


class _Load:
    """One rank's read-once ``read_data`` (the steps are in the module note)."""

    def __init__(
        self, reader: ReadOnceReader, plan: LoadPlan, planner: LoadPlanner, orders: ReadOrders
    ) -> None:
        self.reader, self.plan, self.planner, self.orders = reader, plan, planner, orders
        self.storage_data = reader.storage_data
        self.metadata = reader._read_metadata
        self.me = _dist.rank()
        incoming = {index for _, items in orders.receives for index in items}
        self.own = [req for req in plan.items if req.storage_index not in incoming]
        self.pieces: dict[MetadataIndex, torch.Tensor] = {}
        self.targets: dict[int, torch.Tensor] = {}
        self.decoded: dict[MetadataIndex, torch.Tensor] = {}

    def run(self) -> None:
        error: BaseException | None = None
        try:
            self._read()
            self._resolve_targets()
            nccl = _nccl_ready(self.targets.values())
            if nccl:
                self._decode_sends()
        except Exception as exc:
            error, nccl = exc, False
        outcomes = _dist.agree(
            f"read-once load of {_checkpoint_name(self.reader)}", error, ints=(int(nccl),)
        )
        use_nccl = all(outcome.ints[0] for outcome in outcomes)
        received, arrived = self._exchange(use_nccl)
        logger.debug(
            "read-once load: read %d item(s) for this rank and its peers, received %d from "
            "%d peer(s) over %s",
            len(self.pieces),
            len(received) + len(arrived),
            len(self.orders.receives),
            "NCCL and gloo" if use_nccl else "gloo",
        )
        for position, req in sorted(enumerate(self.plan.items), key=self._file_order):
            target = self.targets.get(position)
            if req.storage_index in arrived:
                _copy_decoded(arrived[req.storage_index], req, target, self.planner)
                continue
            piece = self.pieces.get(req.storage_index)
            where = self.storage_data[req.storage_index].relative_path
            if piece is None:
                piece = received[req.storage_index]
                where = f"{where} (received)"
            load_item(req, piece, self.planner, where, target)

    def _file_order(self, entry: tuple[int, ReadItem]) -> tuple[str, int]:
        info = self.storage_data[entry[1].storage_index]
        return info.relative_path, info.offset

    # -- step 1: read, before anyone is told ----------------------------------------------------

    def _read(self) -> None:
        wanted = dict.fromkeys(
            [req.storage_index for req in self.own]
            + [index for _, items in self.orders.sends for index in items]
        )
        per_file: dict[str, list[MetadataIndex]] = {}
        for index in wanted:
            per_file.setdefault(self.storage_data[index].relative_path, []).append(index)
        names = sorted(per_file)
        self.reader._begin_reads(names)
        whole = self.reader._whole_files()
        for name in names:
            try:
                data = self.reader._file_bytes(name)
                for index in per_file[name]:
                    piece = item_piece(data, self.storage_data[index], name)
                    if not whole:
                        self.reader._count_read(piece.numel())
                    self.pieces[index] = piece
            except Exception as exc:
                raise CheckpointReadError(
                    f"rank {self.me} could not read {name} of {_checkpoint_name(self.reader)}: "
                    f"{type(exc).__name__}: {exc}",
                    rank=self.me,
                    path=name,
                ) from exc

    def _resolve_targets(self) -> None:
        for position, req in enumerate(self.plan.items):
            if req.type != LoadItemType.BYTE_IO:
                self.targets[position] = self.planner.resolve_tensor(req).detach()

    def _decode_sends(self) -> None:
        """Decode and check against the metadata the chunks this rank sends over NCCL, so a bad one
        fails the agreement rather than the transfer.
        """
        for _, items in self.orders.sends:
            for index in items:
                if index in self.decoded or self._is_bytes(index):
                    continue
                saved = item_tensor(self.pieces[index])
                shape, dtype = self._chunk(index)
                if not torch.is_tensor(saved) or saved.dtype != dtype or saved.shape != shape:
                    raise CorruptCheckpointError(
                        f"{self.storage_data[index].relative_path}: item {index.fqn} holds "
                        f"{_describe(saved)}, the metadata says {dtype} {tuple(shape)}",
                        path=self.storage_data[index].relative_path,
                    )
                self.decoded[index] = saved.contiguous()

    # -- step 3: the data ------------------------------------------------------------------------

    def _exchange(
        self, use_nccl: bool
    ) -> tuple[dict[MetadataIndex, torch.Tensor], dict[MetadataIndex, torch.Tensor]]:
        """Stored bytes over gloo; with ``use_nccl``, tensor items' decoded chunks over NCCL."""

        def over_gloo(index: MetadataIndex) -> bool:
            return not use_nccl or self._is_bytes(index)

        received = _exchange(
            _select(self.orders.sends, over_gloo),
            _select(self.orders.receives, over_gloo),
            self.pieces.__getitem__,
            lambda index: self.storage_data[index].length,
            align=1,
            device=torch.device("cpu"),
            group=_dist.library_group(),
        )
        if not use_nccl:
            return received, {}
        device, group = _chunk_transport()
        chunks = _exchange(
            _select(self.orders.sends, lambda index: not over_gloo(index)),
            _select(self.orders.receives, lambda index: not over_gloo(index)),
            lambda index: self.decoded[index].reshape(-1).view(torch.uint8),
            self._chunk_nbytes,
            align=_ALIGN,
            device=device,
            group=group,
        )
        arrived = {}
        for index, raw in chunks.items():
            shape, dtype = self._chunk(index)
            if raw.numel():
                arrived[index] = raw.view(dtype).view(shape)
            else:
                arrived[index] = torch.empty(shape, dtype=dtype, device=device)
        return received, arrived

    # -- the metadata -----------------------------------------------------------------------------

    def _is_bytes(self, index: MetadataIndex) -> bool:
        return self.metadata is not None and isinstance(
            self.metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata
        )

    def _chunk(self, index: MetadataIndex) -> tuple[torch.Size, torch.dtype]:
        """The shape and dtype of the saved chunk ``index`` names."""
        if self.metadata is None:
            raise CorruptCheckpointError("a read-once load ran without the checkpoint metadata")
        entry: Any = self.metadata.state_dict_metadata[index.fqn]
        chunks = entry.chunks
        hint = index.index
        if hint is not None and hint < len(chunks) and chunks[hint].offsets == index.offset:
            return torch.Size(chunks[hint].sizes), entry.properties.dtype
        for chunk in chunks:
            if chunk.offsets == index.offset:
                return torch.Size(chunk.sizes), entry.properties.dtype
        raise CorruptCheckpointError(
            f"the metadata of {index.fqn} has no chunk at offset {tuple(index.offset or ())}"
        )

    def _chunk_nbytes(self, index: MetadataIndex) -> int:
        shape, dtype = self._chunk(index)
        return shape.numel() * dtype.itemsize


def _exchange(
    sends: Sequence[tuple[int, Items]],
    receives: Sequence[tuple[int, Items]],
    payload: Callable[[MetadataIndex], torch.Tensor],
    nbytes: Callable[[MetadataIndex], int],
    *,
    align: int,
    device: torch.device,
    group: Any,
) -> dict[MetadataIndex, torch.Tensor]:
    """One message per peer each way, all posted at once; the items that arrived, each a uint8 view
    of its message. Both sides know every item's size, so a message is only the items' bytes,
    each at a multiple of ``align``.
    """
    ops = []
    # One message per distinct list (one object after unpickling, see _orders): in pure
    # data parallelism a reader holds one copy of what it sends, not one per peer.
    built: dict[int, torch.Tensor] = {}
    for peer, items in sends:
        message = built.get(id(items))
        if message is None:
            message = built[id(items)] = _pack(items, payload, nbytes, align, device)
        if message.numel():
            ops.append(dist.P2POp(dist.isend, message, peer, group))
    inbox = []
    for peer, items in receives:
        offsets, total = _layout(items, nbytes, align)
        message = torch.empty(total, dtype=torch.uint8, device=device)
        if total:
            ops.append(dist.P2POp(dist.irecv, message, peer, group))
        inbox.append((items, offsets, message))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    arrived = {}
    for items, offsets, message in inbox:
        for index, (start, length) in zip(items, offsets, strict=True):
            arrived[index] = message[start : start + length]
    return arrived


def _layout(
    items: Items, nbytes: Callable[[MetadataIndex], int], align: int
) -> tuple[list[tuple[int, int]], int]:
    offsets, position = [], 0
    for index in items:
        length = nbytes(index)
        offsets.append((position, length))
        position += -(-length // align) * align
    return offsets, position


def _pack(
    items: Items,
    payload: Callable[[MetadataIndex], torch.Tensor],
    nbytes: Callable[[MetadataIndex], int],
    align: int,
    device: torch.device,
) -> torch.Tensor:
    offsets, total = _layout(items, nbytes, align)
    message = torch.empty(total, dtype=torch.uint8, device=device)
    for index, (start, length) in zip(items, offsets, strict=True):
        data = payload(index)
        if data.numel() != length:
            raise CorruptCheckpointError(
                f"item {index.fqn} has {data.numel()} bytes to send, its receiver expects {length}"
            )
        message[start : start + length].copy_(data)
    return message


def _select(
    pairs: Iterable[tuple[int, Items]], keep: Callable[[MetadataIndex], bool]
) -> list[tuple[int, Items]]:
    out = []
    for peer, items in pairs:
        kept = tuple(index for index in items if keep(index))
        if kept:
            out.append((peer, items if len(kept) == len(items) else kept))
    return out


def _copy_decoded(
    chunk: torch.Tensor, req: ReadItem, target: torch.Tensor | None, planner: LoadPlanner
) -> None:
    """Copy the part of a received saved chunk that ``req`` reads into its target."""
    if target is None:
        target = planner.resolve_tensor(req).detach()
    tensor = chunk
    for dim, (offset, size) in enumerate(zip(req.storage_offsets, req.lengths, strict=False)):
        if size < tensor.size(dim):
            tensor = tensor.narrow(dim, offset, size)
    if target.size() != tensor.size():
        raise CorruptCheckpointError(
            f"item {req.storage_index.fqn} has size {tuple(tensor.size())}, the state dict "
            f"expects {tuple(target.size())}"
        )
    target.copy_(tensor)
    planner.commit_tensor(req, target)


def _nccl_ready(targets: Iterable[torch.Tensor]) -> bool:
    """Whether the default group is NCCL and every target tensor is on CUDA."""
    if not (torch.cuda.is_available() and _dist.is_distributed()):
        return False
    if "nccl" not in str(dist.get_backend()).lower():
        return False
    return all(target.is_cuda for target in targets)


def _chunk_transport() -> tuple[torch.device, Any]:
    """Where decoded chunks travel: this rank's CUDA device, over the default group (NCCL); a
    function so that a test can route the same path over gloo.
    """
    return torch.device("cuda", torch.cuda.current_device()), None


def _describe(value: Any) -> str:
    if torch.is_tensor(value):
        return f"{value.dtype} {tuple(value.shape)}"
    return type(value).__name__


def _checkpoint_name(reader: Any) -> str:
    return str(getattr(reader, "path", "") or "the checkpoint")
