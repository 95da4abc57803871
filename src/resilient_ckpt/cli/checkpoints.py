"""What the command-line tool knows about checkpoints on disk: find, verify, inspect, convert.

Four kinds are recognised by their shape, never by a registry: a *DCP* checkpoint is a
directory holding ``.metadata`` (complete) or only ``__<rank>_<k>.distcp`` files
(incomplete: never committed); a tiered checkpoint's *memory* tier holds
``<rank>/step_<n>/`` directories (see ``memory_tier``; its durable tier is plain DCP); a
*local* checkpoint root holds ``<session>/<rank>/iter_<n>_<owner>_local.*`` files; any
other ``*.pt`` / ``*.pth`` file is a ``torch.save`` file.

Listing and verification go through the storage backend of the path, so the same walk works
on a local directory and on ``msc://<profile>/<prefix>``: one listing per level (with the
sizes it carries), no per-file calls.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..errors import CheckpointingException, ConfigurationError
from ..storage import PosixBackend, StorageBackend, get_backend
from ..storage.base import Listing, is_msc_url
from ..storage.commit import RecordCommit, is_committed_listing

Progress = Callable[[int], None]


def human(nbytes: float | None) -> str:
    if nbytes is None:
        return "-"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


@dataclass
class Entry:
    kind: str
    path: str
    iteration: int | None = None
    world_size: int | None = None
    nbytes: int = 0
    complete: bool = True
    verified: bool | None = None
    problems: list[str] = field(default_factory=list)
    checks: str = ""  # as in Report, when verified

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Report:
    kind: str
    path: str
    ok: bool
    problems: list[str] = field(default_factory=list)
    nbytes: int = 0
    # What was checked: "crc32" (every byte against the recorded checksums), "read" (no
    # checksums recorded, e.g. a plain dcp.save: sizes, then every item read back) or "load".
    checks: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _is_dcp_dir(path: str) -> bool:
    backend = get_backend(path)
    return backend.is_dir(path) and _is_dcp_listing(backend.scan(path))


def _is_dcp_listing(listing: Listing) -> bool:
    return is_committed_listing(listing) or any(n.endswith(".distcp") for n in listing.files)


def _iteration_of(path: str) -> int | None:
    digits = "".join(c if c.isdigit() else " " for c in os.path.basename(path.rstrip("/")))
    numbers = digits.split()
    return int(numbers[-1]) if numbers else None


def _dcp_entry(
    path: str, listing: Listing, verify: bool, progress: Progress | None = None
) -> Entry:
    complete = is_committed_listing(listing)
    nbytes = sum(listing.files.values())
    entry = Entry("dcp", path, _iteration_of(path), nbytes=nbytes, complete=complete)
    if complete:
        entry.world_size = _dcp_world_size(path)
    if verify:
        report = verify_dcp(path, progress)
        entry.verified, entry.problems, entry.checks = report.ok, report.problems, report.checks
    return entry


def _dcp_world_size(path: str) -> int | None:
    try:
        metadata = read_dcp_metadata(path)
    except Exception:  # listing must not fail on one unreadable checkpoint
        return None
    ranks = set()
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", "")
        if name.startswith("__") and "_" in name[2:]:
            ranks.add(name[2:].split("_", 1)[0])
    return len(ranks) or None


def read_dcp_metadata(path: str) -> Any:
    """The unpickled ``.metadata`` of the DCP checkpoint at ``path`` (any backend)."""
    import pickle

    backend = get_backend(path)
    with backend.open_read(RecordCommit(backend, path).record_path) as f:
        return pickle.load(f)


def verify_dcp(path: str, progress: Progress | None = None) -> Report:
    from ..async_ckpt.verify import verify_checkpoint

    try:
        result = verify_checkpoint(path, progress=progress)
    except CheckpointingException as exc:
        lines = str(exc).splitlines()
        return Report("dcp", path, False, [line.strip() for line in lines[1:]] or lines)
    if result.checksummed:
        return Report("dcp", path, True, [], result.nbytes, checks="crc32")
    # No checksums recorded (a plain dcp.save): sizes were checked; reading every item back
    # catches what sizes cannot (a truncated or garbled pickle, an unreadable tensor).
    from . import conversion

    try:
        conversion.load_dcp(path, progress)
    except BaseException as exc:  # CheckpointException derives from BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return Report("dcp", path, False, [f"reading the items back failed: {exc}"], checks="read")
    return Report("dcp", path, True, [], result.nbytes, checks="read")


def discover(root: str, verify: bool = False, progress: Progress | None = None) -> list[Entry]:
    backend = get_backend(root)
    if not backend.exists(root):
        raise ConfigurationError(f"{root!r} does not exist")
    if not backend.is_dir(root):
        return [_torch_entry(root, backend.size(root), verify, progress)]
    entries: list[Entry] = []
    _walk(backend, root, verify, progress, entries)
    return sorted(entries, key=lambda e: (e.path, e.iteration or 0))


def _walk(
    backend: StorageBackend,
    path: str,
    verify: bool,
    progress: Progress | None,
    entries: list[Entry],
) -> None:
    listing = backend.scan(path)
    if _is_dcp_listing(listing):
        entries.append(_dcp_entry(path, listing, verify, progress))
        return
    memory = _memory_entries(backend, path, verify, progress)
    if memory is not None:
        entries.extend(memory)
        return
    local = _local_entries(backend, path, listing, verify, progress)
    if local is not None:
        entries.extend(local)
        return
    for name in sorted(listing.files):
        if name.endswith((".pt", ".pth")) and not name.startswith("."):
            full = backend.join(path, name)
            entries.append(_torch_entry(full, listing.files[name], verify, progress))
    for name in sorted(listing.dirs):
        _walk(backend, backend.join(path, name), verify, progress, entries)


def _torch_entry(path: str, nbytes: int, verify: bool, progress: Progress | None) -> Entry:
    entry = Entry("torch", path, _iteration_of(path), nbytes=nbytes)
    if verify:
        entry.checks = "load"
        try:
            _load_file(path, progress)
            entry.verified = True
        except Exception as exc:  # any load failure is a verification failure
            entry.verified, entry.problems = False, [f"torch.load failed: {exc}"]
    return entry


def _local_entries(
    backend: StorageBackend,
    path: str,
    listing: Listing,
    verify: bool,
    progress: Progress | None,
) -> list[Entry] | None:
    from . import local_checkpoints

    if not local_checkpoints.is_session_dir(path, backend=backend, listing=listing):
        return None
    rows = local_checkpoints.summarize(path, verify, progress, backend=backend)
    return _rows_as_entries("local", path, verify, rows)


def _memory_entries(
    backend: StorageBackend, path: str, verify: bool, progress: Progress | None
) -> list[Entry] | None:
    from . import memory_tier

    # The memory tier is node-local RAM: plain paths only.
    if not isinstance(backend, PosixBackend) or not memory_tier.is_memory_root(path):
        return None
    return _rows_as_entries("memory", path, verify, memory_tier.summarize(path, verify, progress))


def total_bytes(path: str) -> int:
    """What ``verify_all`` reads, to size a progress bar (listing only)."""
    backend = get_backend(path)
    if backend.exists(path) and not backend.is_dir(path):
        return backend.size(path)
    return sum(e.nbytes for e in discover(path))


def verify_all(path: str, progress: Progress | None = None) -> list[Report]:
    return [
        Report(
            e.kind,
            e.path,
            bool(e.verified) and e.complete,
            # A memory-tier step says itself why it is incomplete (no commit record, or a
            # data file without a valid copy).
            e.problems if e.complete or e.kind == "memory" else ["not committed (incomplete)"],
            e.nbytes,
            e.checks,
        )
        for e in discover(path, verify=True, progress=progress)
    ]


def _describe(key: str, value: Any, out: list[dict[str, Any]]) -> None:
    if isinstance(value, torch.Tensor):
        out.append(
            {
                "key": key,
                "dtype": str(value.dtype).replace("torch.", ""),
                "shape": list(value.shape),
                "nbytes": value.numel() * value.element_size(),
            }
        )
    elif isinstance(value, dict):
        for k, v in value.items():
            _describe(f"{key}.{k}" if key else str(k), v, out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _describe(f"{key}.{i}" if key else str(i), v, out)


def inspect(path: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    backend = get_backend(path)
    if _is_dcp_dir(path):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        metadata = read_dcp_metadata(path)
        for key, md in sorted(metadata.state_dict_metadata.items()):
            if isinstance(md, TensorStorageMetadata):
                dtype = md.properties.dtype
                numel = 1
                for d in md.size:
                    numel *= d
                out.append(
                    {
                        "key": key,
                        "dtype": str(dtype).replace("torch.", ""),
                        "shape": list(md.size),
                        "nbytes": numel * torch.empty(0, dtype=dtype).element_size(),
                    }
                )
        return out
    if backend.exists(path) and not backend.is_dir(path):
        _describe("", _load_file(path), out)
        return out
    from . import local_checkpoints, memory_tier

    if local_checkpoints.is_session_dir(path):
        _describe("", local_checkpoints.load_iteration(path), out)
        return out
    if memory_tier.is_memory_root(path):
        # Every step directory's commit record is the global metadata: the newest will do.
        return inspect(os.path.dirname(memory_tier.newest_metadata(path)))
    raise ConfigurationError(
        f"{path!r} is not a DCP checkpoint, a tiered checkpoint's memory tier, a local "
        "checkpoint session or a checkpoint file"
    )


def _load_file(path: str, progress: Progress | None = None) -> Any:
    from ..local._manifest import parse_name
    from . import conversion, local_checkpoints

    if is_msc_url(path):
        backend = get_backend(path)
        with backend.open_read(path) as f:
            return torch.load(f, map_location="cpu", weights_only=False)
    if parse_name(os.path.basename(path)):
        shard = local_checkpoints.load_shard(path)
        if progress is not None:
            progress(os.path.getsize(path))
        return shard
    return conversion.load_file(path, progress)


def convert(src: str, dst: str, progress: Progress | None = None) -> str:
    """Convert ``src`` into ``dst``; returns what was done. ``progress`` gets byte counts
    (read, then written: about twice the checkpoint's size in all)."""
    from . import conversion

    if is_msc_url(src) or is_msc_url(dst):
        raise ConfigurationError(
            "convert works on local paths only; for msc:// checkpoints load them with "
            "CachedMetadataFileSystemReader and save where you need"
        )
    if os.path.isdir(src) and _is_dcp_dir(src):
        if not RecordCommit(get_backend(src), src).is_committed():
            raise ConfigurationError(f"{src!r} is not committed (no .metadata); nothing to convert")
        conversion.dcp_to_torch(src, dst, progress)
        return "dcp -> torch.save"
    from ..local._manifest import parse_name
    from . import local_checkpoints

    if os.path.isfile(src) and parse_name(os.path.basename(src)):
        conversion.save_file(_load_file(src, progress), dst, progress)
        return "local shard -> torch.save"
    if os.path.isdir(src) and local_checkpoints.is_session_dir(src):
        state = local_checkpoints.load_iteration(src, progress=progress)
        conversion.save_file(state, dst, progress)
        return "local checkpoint (newest complete iteration, all ranks) -> torch.save"
    if os.path.isfile(src):
        if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
            raise ConfigurationError(
                f"destination {dst!r} exists and is not an empty directory; a DCP checkpoint "
                "needs a directory of its own"
            )
        conversion.torch_to_dcp(src, dst, progress)
        return "torch.save -> dcp"
    raise ConfigurationError(f"{src!r} is neither a DCP checkpoint directory nor a file")


def _rows_as_entries(kind: str, path: str, verify: bool, rows: list[dict[str, Any]]) -> list[Entry]:
    """Listing entries from the per-iteration rows a local or memory-tier summary returns."""
    checksum = "crc32" if verify else ""
    return [
        Entry(
            kind,
            path,
            r["iteration"],
            r["world_size"],
            r["nbytes"],
            r["complete"],
            r["verified"],
            r["problems"],
            checksum,
        )
        for r in rows
    ]
