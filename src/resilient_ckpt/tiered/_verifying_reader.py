"""A DCP ``StorageReader`` that finds each data file in any reachable copy and verifies it.

Restore goes through ``torch.distributed.checkpoint.load`` so that its planner does the
resharding: a job restarted at another world size, or with other DTensor placements, reads
exactly the byte ranges it needs. What differs from torch's ``FileSystemReader`` is only
*where a file comes from*: the reader gets, per data file, an ordered list of candidate
paths (this rank's own memory directory first, then its peers'; a durable checkpoint has
one), checks each file's size and CRC32 against the table in the commit record, and falls
over to the next candidate on any mismatch or error. A file with no valid copy raises
:class:`~resilient_ckpt.errors.CorruptCheckpointError`; ``dcp.load`` then fails on every
rank and the manager tries an older checkpoint: wrong bytes are never loaded.

Local copies are mapped and checksummed through the mapping (``local._verified_read``), and the
tensors are copied once from the mapping into the targets (the async readers' ``read_items``;
the tiered writer pads items so their records are aligned views). A memory-tier restore is
therefore one checksum pass and one copy per byte; object-store copies are downloaded whole.

Across nodes: candidates are the paths this process can open, i.e. the rank directories
on its own node (``memory_dir`` is node-local). A memory-tier reader also gets the process
group: in ``read_data`` the files its plan needs and no local copy can serve are received
from ranks that hold them (``_fetch``), checked against the same CRC-32. A file shared by
several new ranks after resharding is checksummed by each of them.

The durable tier is read once (:mod:`~..async_ckpt._read_once`): a data file that several
ranks need is read and checksummed by one of them, which sends each of the others the items
it needs, so a restore reads the shared file system or object store once, not once per
replica. Its unit is the whole file, because a file is verified whole before any item of it
is used. A file that fails its checksum on the rank that reads it fails the load on every
rank (the next checkpoint is then tried), as it would if every rank had read it.
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystemBase
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from .. import _checksum, _restricted_pickle
from .._logging import get_logger
from .._torch_compat import has_stream_transforms
from ..async_ckpt._dcp_items import byte_view, read_items
from ..async_ckpt._read_once import ReadOnceReader
from ..errors import CorruptCheckpointError, StorageError
from ..local._verified_read import check_against_manifest, read_verified
from ..storage import PosixBackend, StorageBackend, get_backend
from ._fetch import exchange_missing
from ._layout import METADATA_NAME

logger = get_logger(__name__)

_CHUNK = 16 << 20


class LocatingFileSystem(FileSystemBase):
    """Read-only ``FileSystemBase``: a file name resolves to its verified bytes."""

    def __init__(
        self,
        metadata: str | bytes,
        candidates: dict[str, list[str]],
        table: dict[str, tuple[int, int]],
        backend: StorageBackend,
        metadata_name: str | None = None,
        on_read: Callable[[int], None] | None = None,
    ) -> None:
        self.metadata = metadata  # the commit record's path, or its bytes
        # What errors call the record: its path, or where its bytes came from.
        self.metadata_name = metadata_name or (
            metadata if isinstance(metadata, str) else "the commit record"
        )
        self.candidates = candidates
        self.table = table
        self.backend = backend
        self.on_read = on_read  # told the size of each copy read and verified
        self.used: dict[str, str] = {}  # file name -> the path (or "rank N") that served it
        self._verified: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if mode != "rb":
            raise StorageError(f"the tiered restore reader is read-only (asked for {mode!r})")
        name = os.path.basename(os.fspath(path))
        if name == METADATA_NAME:
            if isinstance(self.metadata, bytes):
                yield io.BytesIO(self.metadata)
                return
            with self.backend.open_read(self.metadata) as f:
                yield io.BytesIO(f.read())
            return
        yield io.BytesIO(byte_view(self.verified(name)).tobytes())

    def verified(self, name: str) -> torch.Tensor:
        """The bytes of data file ``name`` from its first valid copy, as a uint8 tensor: a
        private mapping of a local file (checksummed through it), or the bytes read from
        an object store."""
        expected = self.table.get(name)
        if expected is None:
            raise CorruptCheckpointError(f"{name} is not in the commit record's file table")
        with self._lock:
            if name in self._verified:
                return self._verified[name]
        problems = []
        for path in self.candidates.get(name, []):
            try:
                data = self._read_checked(path, *expected)
            except (OSError, CorruptCheckpointError) as exc:
                problems.append(f"{path}: {exc}")
                logger.warning("skipping a bad copy of %s at %s: %s", name, path, exc)
                continue
            self.adopt(name, data, path)
            return data
        raise CorruptCheckpointError(
            f"no valid copy of data file {name}: "
            + ("; ".join(problems) if problems else "no reachable copy"),
            path=name,
        )

    def adopt(self, name: str, data: torch.Tensor, source: str) -> None:
        """Keep verified bytes of ``name`` (read here, or received from ``source``)."""
        with self._lock:
            self._verified[name] = data
            self.used[name] = source

    def release(self) -> None:
        """Drop the verified copies (their mappings) once the load has copied them out."""
        with self._lock:
            self._verified.clear()

    def reachable(self) -> list[str]:
        """The data files this process has some copy of (not yet verified)."""
        return sorted(name for name, paths in self.candidates.items() if paths)

    def _read_checked(self, path: str, size: int, crc: int) -> torch.Tensor:
        if isinstance(self.backend, PosixBackend):
            verified = read_verified(path, size, crc)
        else:
            data = _read_all(self.backend, path)
            check_against_manifest(path, len(data), _checksum.crc32(data), size, crc)
            verified = (
                torch.frombuffer(data, dtype=torch.uint8)
                if data
                else torch.empty(0, dtype=torch.uint8)
            )
        if self.on_read is not None:
            self.on_read(verified.numel())
        return verified

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return os.path.join(os.fspath(path), suffix)

    def init_path(self, path: str | os.PathLike) -> str | os.PathLike:
        return path

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        raise StorageError("the tiered restore reader is read-only")

    def mkdir(self, path: str | os.PathLike) -> None:
        raise StorageError("the tiered restore reader is read-only")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def exists(self, path: str | os.PathLike) -> bool:
        name = os.path.basename(os.fspath(path))
        return name == METADATA_NAME or name in self.candidates

    def rm_file(self, path: str | os.PathLike) -> None:
        raise StorageError("the tiered restore reader is read-only")


def _read_all(backend: StorageBackend, path: str) -> bytearray:
    out = bytearray()
    with backend.open_read(path) as f:
        while chunk := f.read(_CHUNK):
            out += chunk
    return out


class VerifyingReader(ReadOnceReader, FileSystemReader):
    """``FileSystemReader`` over a :class:`LocatingFileSystem` (see the module docstring).

    A durable restore reads once across ranks (:mod:`~..async_ckpt._read_once`): each data
    file that several ranks need is read and checksummed by one of them, which sends the
    others the items they need; a rank whose file fails its checksum makes every rank fail
    the load (``RankCheckpointReadError``), and the manager tries the next checkpoint.
    ``read_once`` as the async reader's (None: ``RESILIENT_CKPT_READ_ONCE``). A memory-tier
    reader (``exchange_group`` set) reads alone: its copies are in node-local memory, and
    its own exchange carries only what a node lacks. ``bytes_read`` counts the files this
    rank read (not those received).
    """

    telemetry_flow = None  # the manager reports its restore, with the step and the tier

    def __init__(
        self,
        checkpoint_id: str,
        metadata: str | bytes,
        candidates: dict[str, list[str]],
        table: dict[str, tuple[int, int]],
        *,
        exchange_group: Any = None,
        read_once: bool | None = None,
        metadata_name: str | None = None,
    ) -> None:
        super().__init__(
            checkpoint_id, read_once=False if exchange_group is not None else read_once
        )
        self.fs = LocatingFileSystem(  # type: ignore[assignment]
            metadata,
            candidates,
            table,
            get_backend(checkpoint_id),
            metadata_name,
            on_read=self._count_read,
        )
        self.path = checkpoint_id
        # Memory tier: files this rank needs but cannot reach come from ranks that can.
        self.exchange_group = exchange_group

    def reset(self, checkpoint_id: Any = None) -> None:
        # dcp.load resets with its checkpoint_id argument (None here): keep our path.
        super().reset(None)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The commit record, unpickled with the restricted unpickler (torch's reader would
        unpickle it freely): a record naming any global DCP's metadata never holds is
        refused, never run."""
        fs = cast(LocatingFileSystem, self.fs)
        with fs.create_stream(METADATA_NAME, "rb") as f:
            metadata = _restricted_pickle.load(f, path=fs.metadata_name, expect=Metadata)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata  # type: ignore[no-any-return]

    def _read_alone(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Each file verified once, its tensors copied once into the targets, straight
        from the mapped copy (``read_items``); items with stream transforms go through
        torch's reader."""
        if has_stream_transforms(self.storage_data, plan.items):
            return FileSystemReader.read_data(self, plan, planner)
        fs = cast(LocatingFileSystem, self.fs)
        if self.exchange_group is not None:
            needed = {self.storage_data[i.storage_index].relative_path for i in plan.items}
            exchange_missing(fs, sorted(needed), self.exchange_group)
        try:
            return read_items(plan, planner, self.storage_data, fs.verified)
        finally:
            self._release_files()

    def _whole_files(self) -> bool:
        return True  # a file is checksummed whole before any of its items is used

    def _file_bytes(self, name: str) -> torch.Tensor:
        return cast(LocatingFileSystem, self.fs).verified(name)

    def _release_files(self) -> None:
        cast(LocatingFileSystem, self.fs).release()  # no mapping outlives the load
