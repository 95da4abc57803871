"""File names and manifests of local checkpoint copies.

A rank directory ``<root>/<session_id>/<rank>/`` holds, per iteration, one *copy* per shard
it stores (its own and, replicated, its clique peers'). A copy is two files:

* ``iter_<iteration:07d>_<owner>_local.pt``: the shard bytes, named ``...local.dirty.pt``
  (NVRx's name) until the save is committed on all ranks;
* ``iter_<iteration:07d>_<owner>_local.manifest.json``: size, CRC-32, world size and
  replication parameters of that file, written atomically before the rename.

A replicated async save in flight also leaves ``..._<rank>_local.status``
(:mod:`resilient_ckpt.local._background`). A copy *counts* when both files exist and the size
matches, and is *valid* when the CRC matches too. Iterations past seven digits take more, and
are compared as numbers, never by name.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import CorruptCheckpointError

MANIFEST_VERSION = 1
DATA = "data"
DIRTY = "dirty"
MANIFEST = "manifest"
STATUS = "status"

_NAME = re.compile(r"iter_(\d{7,})_(\d+)_local(\.pt|\.dirty\.pt|\.manifest\.json|\.status)")
_KINDS = {".pt": DATA, ".dirty.pt": DIRTY, ".manifest.json": MANIFEST, ".status": STATUS}
_SUFFIX = {kind: suffix for suffix, kind in _KINDS.items()}


def file_name(iteration: int, owner: int, kind: str = DATA) -> str:
    return f"iter_{iteration:07d}_{owner}_local{_SUFFIX[kind]}"


def parse_name(name: str) -> tuple[int, int, str] | None:
    """(iteration, owner rank, kind) of a copy file name; None for any other name."""
    match = _NAME.fullmatch(name)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2)), _KINDS[match.group(3)]


def is_temp_name(name: str) -> bool:
    """A temporary file left by an interrupted atomic write (``.<name>.tmp-<pid>``)."""
    return name.startswith(".iter_") and ".tmp-" in name


@dataclass(frozen=True)
class Manifest:
    """What a copy's file must be: written with it, checked before it is used."""

    iteration: int
    owner: int
    session_id: str
    size: int
    crc32: int
    world_size: int
    replication: dict[str, Any] | None = None
    format_version: int = MANIFEST_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, path: str) -> Manifest:
        try:
            fields = json.loads(raw)
            manifest = cls(**fields)
        except (ValueError, TypeError) as exc:
            raise CorruptCheckpointError(f"{path}: unreadable manifest: {exc}", path=path) from exc
        if manifest.format_version != MANIFEST_VERSION:
            raise CorruptCheckpointError(
                f"{path}: manifest version {manifest.format_version} is not supported", path=path
            )
        return manifest


@dataclass(frozen=True)
class CopyInfo:
    """A committed copy one rank holds (what ``find_latest`` gathers from every rank)."""

    iteration: int
    owner: int
    holder: int
    size: int
    crc32: int
    world_size: int
    replication: dict[str, Any] | None
    path: str
    # Written by NVRx (a torch.save archive, no manifest): ``crc32`` is unknown (-1) and the
    # archive's own record checksums are verified instead (see ``._nvrx_format``).
    nvrx: bool = False
