"""The command-line tool's view of local checkpoints (``LocalCheckpointManager``'s files).

A *session directory* ``<root>/<session>/`` holds one directory per rank; each holds copies
``iter_<n>_<owner>_local.pt`` with a JSON manifest. An iteration is *complete* when every
owner rank has at least one committed copy (data file + manifest, size as recorded) on any
holder (replicas count), and *verified* when every such copy's CRC-32 was re-read and
matched. Works without a process group: it only reads files, through the storage backend
of the path (listing and verification; loading a shard reads local files).

Listing and verifying never unpickle anything (sizes and checksums of the bytes). Loading a
shard's state uses the managers' safe mode (``weights_only=True``: plain values, the
format's own classes and the globals marked safe) unless the caller says the files are
trusted.
"""

from __future__ import annotations

import os
import zlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import (
    CheckpointingException,
    ConfigurationError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from ..local import _nvrx_format
from ..local._format import check_against_manifest, deserialize, read_verified
from ..local._manifest import DATA, MANIFEST, Manifest, file_name, parse_name
from ..storage import PosixBackend, StorageBackend, get_backend
from ..storage.base import Listing
from ..utils import preload_tensors

_CHUNK = 8 << 20


@dataclass
class LocalCopy:
    iteration: int
    owner: int
    holder: int
    path: str
    manifest: Manifest | None
    problem: str | None = None
    size: int = 0


def is_session_dir(
    path: str, *, backend: StorageBackend | None = None, listing: Listing | None = None
) -> bool:
    """``path`` holds only rank directories, and some hold local checkpoint files."""
    backend = backend or get_backend(path)
    try:
        subdirs = (listing or backend.scan(path)).dirs
        return (
            bool(subdirs)
            and all(d.isdigit() for d in subdirs)
            and any(parse_name(n) for d in subdirs for n in backend.list(backend.join(path, d)))
        )
    except OSError:
        return False


def copies(session_dir: str, *, backend: StorageBackend | None = None) -> list[LocalCopy]:
    backend = backend or get_backend(session_dir)
    found = []
    for holder_name in sorted(backend.scan(session_dir).dirs, key=lambda n: int(n)):
        holder_dir = backend.join(session_dir, holder_name)
        sizes = backend.scan(holder_dir).files
        for name in sorted(sizes):
            parsed = parse_name(name)
            if parsed is None or parsed[2] != DATA:
                continue
            iteration, owner, _ = parsed
            path = backend.join(holder_dir, name)
            copy = LocalCopy(iteration, owner, int(holder_name), path, None, size=sizes[name])
            manifest_path = backend.join(holder_dir, file_name(iteration, owner, MANIFEST))
            try:
                with backend.open_read(manifest_path) as f:
                    copy.manifest = Manifest.from_json(f.read(), manifest_path)
            except FileNotFoundError:
                copy.problem = f"{path}: no manifest ({manifest_path} missing): not committed"
            except CheckpointingException as exc:
                copy.problem = str(exc)
            if copy.manifest is not None and copy.size != copy.manifest.size:
                copy.problem = f"{path}: {copy.size} bytes, manifest says {copy.manifest.size}"
            found.append(copy)
    return found


def verify_copy(copy: LocalCopy, *, backend: StorageBackend | None = None) -> None:
    if copy.problem is None and copy.manifest is not None:
        backend = backend or get_backend(copy.path)
        try:
            if isinstance(backend, PosixBackend):
                read_verified(copy.path, copy.manifest.size, copy.manifest.crc32)
            else:
                _verify_stream(backend, copy.path, copy.manifest.size, copy.manifest.crc32)
        except CheckpointingException as exc:
            copy.problem = str(exc)


def _verify_stream(backend: StorageBackend, path: str, size: int, crc32: int) -> None:
    """``read_verified``'s checks, streaming through any backend (no tensor is built)."""
    crc, got = 0, 0
    with backend.open_read(path) as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            got += len(chunk)
    check_against_manifest(path, got, crc, size, crc32)


def summarize(
    session_dir: str,
    verify: bool,
    progress: Callable[[int], None] | None = None,
    *,
    backend: StorageBackend | None = None,
) -> list[dict[str, Any]]:
    """One record per iteration: world size, bytes, complete, verified, problems."""
    backend = backend or get_backend(session_dir)
    by_iteration: dict[int, list[LocalCopy]] = defaultdict(list)
    for copy in copies(session_dir, backend=backend):
        if verify:
            verify_copy(copy, backend=backend)
            if progress is not None:
                progress(copy.size)
        by_iteration[copy.iteration].append(copy)
    records = []
    for iteration, group in sorted(by_iteration.items()):
        worlds = {c.manifest.world_size for c in group if c.manifest is not None}
        world = max(worlds) if worlds else None
        good_owners = {c.owner for c in group if c.problem is None and c.manifest is not None}
        complete = world is not None and good_owners >= set(range(world))
        records.append(
            {
                "iteration": iteration,
                "world_size": world,
                "nbytes": sum(c.size for c in group),
                "complete": complete,
                "verified": (complete and all(c.problem is None for c in group))
                if verify
                else None,
                "problems": [c.problem for c in group if c.problem]
                + (
                    []
                    if complete
                    else [
                        f"iteration {iteration}: owner rank(s) "
                        f"{sorted(set(range(world or 0)) - good_owners)} have no "
                        "valid copy"
                    ]
                ),
            }
        )
    return records


def _manifest_path(path: str) -> str:
    parsed = parse_name(os.path.basename(path))
    if parsed is None or parsed[2] != DATA:
        raise ConfigurationError(f"{path!r} is not a local checkpoint file (iter_<n>_<r>_local.pt)")
    return os.path.join(os.path.dirname(path), file_name(parsed[0], parsed[1], MANIFEST))


def shard_problem(path: str) -> str | None:
    """Why one local copy file is not committed (no manifest, and not a file NVRx wrote),
    from the file's name and first bytes; None if it is."""
    manifest_path = _manifest_path(path)
    if os.path.exists(manifest_path) or _nvrx_format.is_nvrx_file(path):
        return None
    return f"{path}: no manifest ({os.path.basename(manifest_path)} missing): not committed"


def _verified_bytes(path: str) -> Any:
    """One local copy file's bytes (a uint8 tensor), checked against its manifest (or, for
    a file NVRx wrote, against the checksums inside it); nothing is unpickled."""
    manifest_path = _manifest_path(path)
    if not os.path.exists(manifest_path):
        problem = shard_problem(path)
        if problem is not None:
            raise CorruptCheckpointError(problem, path=path)
        # Written by NVRx: verified by the archive's own checksums (local._nvrx_format).
        return _nvrx_format.read_verified_nvrx(path)
    with open(manifest_path, "rb") as f:
        manifest = Manifest.from_json(f.read(), manifest_path)
    return read_verified(path, manifest.size, manifest.crc32)


def verify_shard(path: str) -> int:
    """Check one local copy file's bytes (see :func:`_verified_bytes`); its size."""
    return int(_verified_bytes(path).numel())


def load_shard(path: str, *, trusted: bool = False) -> Any:
    """The state dict stored in one local copy file, checked as :func:`verify_shard` does.
    Unpickled in the managers' safe mode (plain values, the format's classes and the
    globals marked safe; a refused one is a named error) unless ``trusted``."""
    state = deserialize(_verified_bytes(path), weights_only=not trusted, source=path)
    # The tensors view one shard buffer in several dtypes; give each its own storage so the
    # result can be handed to torch.save.
    return preload_tensors(getattr(state, "state_dict", state), non_blocking=False)


def load_iteration(
    session_dir: str,
    iteration: int | None = None,
    progress: Callable[[int], None] | None = None,
    *,
    trusted: bool = False,
) -> dict[str, Any]:
    """{"rank<r>": state_dict} of one complete iteration (default: the newest), any copy,
    each read as :func:`load_shard` reads it."""
    complete = [r["iteration"] for r in summarize(session_dir, verify=False) if r["complete"]]
    if not complete:
        raise ConfigurationError(f"{session_dir!r} holds no complete local checkpoint")
    target = max(complete) if iteration is None else iteration
    out: dict[str, Any] = {}
    failed: dict[str, CheckpointingException] = {}
    for copy in copies(session_dir):
        key = f"rank{copy.owner}"
        if copy.iteration != target or key in out or copy.problem:
            continue
        try:
            out[key] = load_shard(copy.path, trusted=trusted)
        except UnsafeCheckpointError:
            raise  # every copy holds the same state: another would be refused too
        except CheckpointingException as exc:
            failed[key] = exc  # a damaged copy: another holder's may be intact
            continue
        if progress is not None:
            progress(os.path.getsize(copy.path))
    for key, error in failed.items():
        if key not in out:
            raise error
    return dict(sorted(out.items(), key=lambda kv: int(kv[0][4:])))
