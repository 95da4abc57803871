"""Checkpoint format conversions for the command-line tool, reporting bytes as they move.

* DCP -> one ``torch.save`` file: the state dict is rebuilt from the checkpoint's metadata
  (an empty tensor of each item's whole size, nested as it was saved), as torch's
  ``dcp_to_torch_save`` does, so sharded tensors come back whole; ``dcp.load`` fills it
  through torch's default load planner, counting bytes as each item lands.
* ``torch.save`` file -> DCP: the file is read through a counting wrapper and written by
  :class:`~resilient_ckpt.async_ckpt.filesystem_async.FileSystemWriterAsync`, whose
  ``.metadata`` records every data file's CRC-32, so ``resilient-ckpt verify`` can check
  every byte of the result later (a plain ``FileSystemWriter`` records none).

``torch.save`` outputs are written to a temporary name and renamed, so an interrupted
conversion leaves either no file or a complete one. The progress callback receives byte
counts; the caller decides how to show them.

Nothing read here runs a file's code unless ``trusted`` (see :mod:`._trust`): the DCP
``.metadata`` is read by the restricted unpickler before ``dcp.load`` starts and handed to
it, a DCP checkpoint's non-tensor items (which torch's default planner loads with
``weights_only=False``) and ``torch.save`` files are loaded with ``weights_only=True``.
torch's reader loads the tensor items with ``weights_only=True`` itself.
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Callable, Sequence
from typing import IO, Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from ..errors import CheckpointingException, CorruptCheckpointError
from ..storage.commit import write_atomically
from . import _trust
from ._dcp_metadata import read_dcp_metadata

Progress = Callable[[int], None]


def _ignore(nbytes: int) -> None:
    return None


class CountingFile:
    """A file object that reports the bytes read from or written to it.

    ``torch.load`` seeks and reads some records twice (the zip directory, then each entry's
    header), so reads are reported up to ``limit`` (the file's size) and no further: a bar
    sized to the file ends at 100 %, not past it.
    """

    def __init__(self, f: IO[bytes], progress: Progress, limit: int | None = None) -> None:
        self._f = f
        self._progress = progress
        self._left = limit

    def _report_read(self, n: int) -> None:
        if self._left is not None:
            n = min(n, self._left)
            self._left -= n
        if n:
            self._progress(n)

    def read(self, size: int = -1) -> bytes:
        data = self._f.read(size)
        self._report_read(len(data))
        return data

    def readinto(self, buffer: Any) -> int:
        n = self._f.readinto(buffer)  # type: ignore[attr-defined]
        self._report_read(n or 0)
        return n

    def write(self, data: Any) -> int:
        n = self._f.write(data)
        self._progress(n if n is not None else memoryview(data).nbytes)
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def load_file(path: str, progress: Progress | None = None, *, trusted: bool = False) -> Any:
    """``torch.load`` of a whole file onto the CPU, reporting bytes read; safely
    (``weights_only=True``) unless ``trusted``."""
    with open(path, "rb") as f:
        counted = CountingFile(f, progress or _ignore, limit=os.path.getsize(path))
        return _trust.torch_load(counted, path=path, trusted=trusted)  # type: ignore[arg-type]


def save_file(obj: Any, path: str, progress: Progress | None = None) -> None:
    """``torch.save`` to ``path`` atomically (temporary name, fsync, rename)."""
    write_atomically(path, lambda f: torch.save(obj, CountingFile(f, progress or _ignore)))


class _WholeStateLoadPlanner(DefaultLoadPlanner):
    """Loads every item of a checkpoint into a state dict it builds from the metadata (the
    one ``dcp.load`` hands it, kept as :attr:`loaded`), reporting bytes as they land.
    Non-tensor items are loaded safely unless ``trusted``."""

    def __init__(self, progress: Progress, src: str, trusted: bool) -> None:
        super().__init__()
        self._progress = progress
        self._src = src
        self._trusted = trusted
        self._paths: dict[str, Any] = {}
        self.loaded: dict[str, Any] = {}

    def set_up_planner(
        self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        if metadata is None:
            raise ValueError("loading a whole checkpoint needs its metadata")
        planner_data = metadata.planner_data or {}
        for key, md in metadata.state_dict_metadata.items():
            value: Any = md
            if isinstance(md, TensorStorageMetadata):
                value = torch.empty(md.size, dtype=md.properties.dtype)
            _set_path(state_dict, planner_data.get(key, (key,)), value)
        self.loaded = state_dict
        self._paths = planner_data
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # Not the default planner's: it loads these with weights_only=False. The item goes
        # where set_up_planner put its placeholder, as the default planner would put it.
        self._progress(value.getbuffer().nbytes)
        key = read_item.dest_index.fqn
        where = f"{self._src} (item {key!r})"
        loaded = _trust.torch_load(value, path=where, trusted=self._trusted)
        _set_path(self.loaded, self._paths.get(key, (key,)), loaded)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        self._progress(tensor.numel() * tensor.element_size())
        super().commit_tensor(read_item, tensor)


def _set_path(root: dict[str, Any], path: Sequence[Any], value: Any) -> None:
    """Put ``value`` at ``path`` (keys and list indices, as DCP's flattening records them),
    making the dicts and lists on the way (lists padded with None)."""
    container: Any = root
    for key, next_key in zip(path, path[1:], strict=False):
        if isinstance(container, list):
            container.extend([None] * (key + 1 - len(container)))
            if container[key] is None:
                container[key] = {} if isinstance(next_key, str) else []
            container = container[key]
        else:
            container = container.setdefault(key, {} if isinstance(next_key, str) else [])
    last = path[-1]
    if isinstance(last, int):
        container.extend([None] * (last + 1 - len(container)))
    container[last] = value


class _ReadMetadataReader(FileSystemReader):
    """torch's reader, handed the metadata already read (by the restricted unpickler):
    its own ``read_metadata`` unpickles ``.metadata`` with ``pickle.load``."""

    def __init__(self, path: str, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self._metadata
        # As torch's reader does, where this torch has load ids: this load's id on it.
        if hasattr(self, "load_id") and hasattr(metadata, "storage_meta"):
            from torch.distributed.checkpoint.metadata import StorageMeta

            if metadata.storage_meta is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
        return metadata


def load_dcp(
    src: str, progress: Progress | None = None, *, trusted: bool = False
) -> dict[str, Any]:
    """Every item of a committed DCP checkpoint, whole tensors on the CPU; its metadata
    and non-tensor items are loaded safely unless ``trusted``."""
    import torch.distributed.checkpoint as dcp

    from .._torch_compat import no_dist_kwargs

    metadata = read_dcp_metadata(src, trusted=trusted)
    planner = _WholeStateLoadPlanner(progress or _ignore, src, trusted)
    with warnings.catch_warnings():
        # This process loads alone on purpose: not worth a warning.
        warnings.filterwarnings("ignore", message=r"torch\.distributed is .*single process")
        try:
            dcp.load(
                {},
                storage_reader=_ReadMetadataReader(src, metadata),
                planner=planner,
                **no_dist_kwargs(dcp.load),
            )
        except dcp.CheckpointException as exc:
            raise _unwrapped(exc, src) from exc
    return planner.loaded


def _unwrapped(exc: BaseException, src: str) -> Exception:
    """What failed inside torch's ``CheckpointException`` (dcp.load reports every rank's
    failures as one, a ``BaseException``): a named error of ours or an ``OSError`` as it is,
    anything else as the checkpoint's data being unreadable."""
    failures = [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]  # type: ignore[attr-defined]
    for inner in failures:
        if isinstance(inner, (CheckpointingException, OSError)):
            return inner
    what = "; ".join(f"{type(e).__name__}: {e}" for e in failures) or str(exc)
    return CorruptCheckpointError(f"{src}: its data cannot be read ({what})", path=src)


def dcp_to_torch(
    src: str, dst: str, progress: Progress | None = None, *, trusted: bool = False
) -> None:
    """A committed DCP checkpoint directory into one ``torch.save`` file."""
    save_file(load_dcp(src, progress, trusted=trusted), dst, progress)


def torch_to_dcp(
    src: str, dst: str, progress: Progress | None = None, *, trusted: bool = False
) -> None:
    """A ``torch.save`` file (a dict) into a DCP checkpoint directory with checksums."""
    import torch.distributed.checkpoint as dcp

    from .._torch_compat import no_dist_kwargs
    from ..async_ckpt.filesystem_async import FileSystemWriterAsync
    from ..errors import ConfigurationError

    state = load_file(src, progress, trusted=trusted)
    if not isinstance(state, dict):
        raise ConfigurationError(
            f"{src!r} holds a {type(state).__name__}; only a dict (a state dict) converts to DCP"
        )
    os.makedirs(dst, exist_ok=True)
    dcp.save(state, storage_writer=FileSystemWriterAsync(dst), **no_dist_kwargs(dcp.save))
    if progress is not None:
        progress(sum(e.stat().st_size for e in os.scandir(dst) if e.is_file()))
