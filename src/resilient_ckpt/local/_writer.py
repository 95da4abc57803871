"""Writing local checkpoint copies: the ``async_fn`` of a local save.

:func:`write_copies` runs in the background worker, a forked child or the trainer
(synchronous save), so it is a module-level function of plain picklable arguments (the
:class:`CopyTarget` list and, in order, the sources: a shard layout to stream or a buffer
received from a peer); it touches no trainer state and makes no collective call. Per copy:
the data under the *dirty* name, fsynced, then the manifest (size and CRC-32 of exactly the
bytes written) atomically. The final name comes only at commit, in the trainer; a crash
before leaves a dirty file and an orphan manifest, which the next ``find_latest`` removes.
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
    """The sources with every device tensor on the host (``preload_fn``): a no-op in the
    persistent worker, where staging put them there; before the fork on the fork queue,
    since the child cannot read device memory."""
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
