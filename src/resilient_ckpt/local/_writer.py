"""Writing local checkpoint copies: the ``async_fn`` of a local save.

:func:`write_copies` runs in the background worker (persistent queue), in a forked child
(fork queue) or in the trainer (synchronous save), so it is a module-level function whose
arguments are plain picklable values: a list of :class:`CopyTarget` and, in the same
order, the sources (a :class:`~._format.ShardLayout` whose tensors are streamed, or a ready
uint8 buffer received from a peer). It never touches trainer state and makes no
collective call.

For each copy it writes the data to the *dirty* name and fsyncs it, then writes the
manifest (size and CRC-32 of exactly the bytes written) atomically. The data gets its final
name only in the commit step, in the trainer, once every rank's writes succeeded; a crash
before that leaves a dirty file and an orphan manifest, which the next ``find_latest``
removes.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import SameMachineReplicationException, StorageError
from ..storage.commit import atomic_file
from ._format import ShardBuffer, ShardLayout, stream_to
from ._manifest import DATA, DIRTY, MANIFEST, Manifest, file_name

Source = ShardLayout | ShardBuffer | torch.Tensor


@dataclass(frozen=True)
class CopyTarget:
    """Where one copy goes and what its manifest says (size and CRC filled in on write)."""

    ckpt_id: tuple[int, int, Any]
    directory: str
    manifest: Manifest
    sync: bool = True

    def path(self, kind: str) -> str:
        iteration, owner, _ = self.ckpt_id
        return os.path.join(self.directory, file_name(iteration, owner, kind))


def _write_copy(target: CopyTarget, source: Source) -> None:
    if os.path.exists(target.path(DATA)):
        raise SameMachineReplicationException(target.ckpt_id)
    dirty = target.path(DIRTY)
    try:
        with open(dirty, "wb") as f:
            size, crc = stream_to(f, source)
            f.flush()
            if target.sync:
                os.fsync(f.fileno())
        manifest = dataclasses.replace(target.manifest, size=size, crc32=crc)
        _write_manifest(target.path(MANIFEST), manifest.to_json(), target.sync)
    except OSError as exc:
        # The copy can never be committed: give its space back now (a full disk is the
        # usual cause, and the next save needs that space).
        _remove_quietly(dirty)
        raise StorageError(f"writing local checkpoint {dirty} failed: {exc}") from exc


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _write_manifest(path: str, body: bytes, sync: bool) -> None:
    """Temporary name, fsync, rename. No directory fsync here: the commit's covers it."""
    with atomic_file(path, sync=sync, sync_dir=False) as f:
        f.write(body)


def write_copies(targets: Sequence[CopyTarget], sources: Sequence[Source]) -> None:
    """Write every copy (see the module docstring). Raises on the first failure."""
    if len(targets) != len(sources):
        raise StorageError(f"{len(targets)} copy targets but {len(sources)} sources")
    seen = set()
    for target in targets:
        if target.ckpt_id in seen:
            raise SameMachineReplicationException(target.ckpt_id)
        seen.add(target.ckpt_id)
    for target, source in zip(targets, sources, strict=True):
        _write_copy(target, source)


def on_host(sources: Sequence[Source]) -> list[Source]:
    """The sources with every device tensor copied to the host (``preload_fn``).

    On the persistent queue this runs in the worker, where staging already put every tensor
    on the host (a no-op); on the fork queue it runs in the trainer before the fork, where
    device memory cannot be read from the child.
    """
    result: list[Source] = []
    for source in sources:
        if isinstance(source, torch.Tensor):
            result.append(source.cpu())
        elif isinstance(source, ShardBuffer):
            result.append(ShardBuffer(source.data.cpu(), source.crc32))
        else:
            tensors = [t.detach().cpu() for t in source.tensors]
            result.append(dataclasses.replace(source, tensors=tensors))
    return result
