"""What the command-line tool knows about checkpoints on disk: find, verify, inspect, convert.

Three kinds are recognised by their shape, never by a registry: a *DCP* checkpoint is a
directory holding ``.metadata`` (complete) or only ``__<rank>_<k>.distcp`` files
(incomplete: never committed); a *local* checkpoint root holds
``<session>/<rank>/iter_<n>_<owner>_local.*`` files; any other ``*.pt`` / ``*.pth`` file is a
``torch.save`` file.

Listing and verification go through the storage backend of the path, so the same walk works
on a local directory and on ``msc://<profile>/<prefix>``: one listing per level (with the
sizes it carries), no per-file calls.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .errors import CheckpointingException, ConfigurationError
from .storage import StorageBackend, get_backend
from .storage.base import Listing, is_msc_url

DEFAULT_BENCHMARKS = ["async_save", "dcp_save", "local_ckpt"]
_METADATA = ".metadata"


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

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Report:
    kind: str
    path: str
    ok: bool
    problems: list[str] = field(default_factory=list)
    nbytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _is_dcp_dir(path: str) -> bool:
    backend = get_backend(path)
    return backend.is_dir(path) and _is_dcp_listing(backend.scan(path))


def _is_dcp_listing(listing: Listing) -> bool:
    return _METADATA in listing.files or any(n.endswith(".distcp") for n in listing.files)


def _iteration_of(path: str) -> int | None:
    digits = "".join(c if c.isdigit() else " " for c in os.path.basename(path.rstrip("/")))
    numbers = digits.split()
    return int(numbers[-1]) if numbers else None


def _dcp_entry(path: str, listing: Listing, verify: bool) -> Entry:
    complete = _METADATA in listing.files
    nbytes = sum(listing.files.values())
    entry = Entry("dcp", path, _iteration_of(path), nbytes=nbytes, complete=complete)
    if complete:
        entry.world_size = _dcp_world_size(path)
    if verify:
        report = verify_dcp(path)
        entry.verified, entry.problems = report.ok, report.problems
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
    with backend.open_read(backend.join(path, _METADATA)) as f:
        return pickle.load(f)


def verify_dcp(path: str) -> Report:
    from .async_ckpt.verify import verify_checkpoint

    try:
        result = verify_checkpoint(path)
    except CheckpointingException as exc:
        lines = str(exc).splitlines()
        return Report("dcp", path, False, [line.strip() for line in lines[1:]] or lines)
    return Report("dcp", path, True, [], result.nbytes)


def discover(root: str, verify: bool = False) -> list[Entry]:
    backend = get_backend(root)
    if not backend.exists(root):
        raise ConfigurationError(f"{root!r} does not exist")
    if not backend.is_dir(root):
        return [Entry("torch", root, _iteration_of(root), nbytes=backend.size(root))]
    entries: list[Entry] = []
    _walk(backend, root, verify, entries)
    return sorted(entries, key=lambda e: (e.path, e.iteration or 0))


def _walk(backend: StorageBackend, path: str, verify: bool, entries: list[Entry]) -> None:
    listing = backend.scan(path)
    if _is_dcp_listing(listing):
        entries.append(_dcp_entry(path, listing, verify))
        return
    local = _local_entries(backend, path, listing, verify)
    if local is not None:
        entries.extend(local)
        return
    for name in sorted(listing.files):
        if name.endswith((".pt", ".pth")) and not name.startswith("."):
            full = backend.join(path, name)
            entries.append(Entry("torch", full, _iteration_of(full), nbytes=listing.files[name]))
    for name in listing.dirs:
        _walk(backend, backend.join(path, name), verify, entries)


def _local_entries(
    backend: StorageBackend, path: str, listing: Listing, verify: bool
) -> list[Entry] | None:
    from . import _catalog_local

    if not _catalog_local.is_session_dir(path, backend=backend, listing=listing):
        return None
    return [
        Entry(
            "local",
            path,
            r["iteration"],
            r["world_size"],
            r["nbytes"],
            r["complete"],
            r["verified"],
            r["problems"],
        )
        for r in _catalog_local.summarize(path, verify, backend=backend)
    ]


def verify_all(path: str, progress: bool = True) -> list[Report]:
    backend = get_backend(path)
    if backend.exists(path) and not backend.is_dir(path):
        try:
            _load_file(path)
        except Exception as exc:  # any load failure is a verification failure
            return [Report("torch", path, False, [f"torch.load failed: {exc}"])]
        return [Report("torch", path, True, [], backend.size(path))]
    return [
        Report(
            e.kind,
            e.path,
            bool(e.verified) and e.complete,
            e.problems if e.complete else ["not committed (incomplete)"],
            e.nbytes,
        )
        for e in discover(path, verify=True)
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
    from . import _catalog_local

    if _catalog_local.is_session_dir(path):
        _describe("", _catalog_local.load_iteration(path), out)
        return out
    raise ConfigurationError(
        f"{path!r} is not a DCP checkpoint, a local checkpoint session or a checkpoint file"
    )


def _load_file(path: str) -> Any:
    from . import _catalog_local
    from .local._manifest import parse_name

    if is_msc_url(path):
        backend = get_backend(path)
        with backend.open_read(path) as f:
            return torch.load(f, map_location="cpu", weights_only=False)
    if parse_name(os.path.basename(path)):
        return _catalog_local.load_shard(path)
    return torch.load(path, map_location="cpu", weights_only=False)


def convert(src: str, dst: str) -> str:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    if is_msc_url(src) or is_msc_url(dst):
        raise ConfigurationError(
            "convert works on local paths only; for msc:// checkpoints load them with "
            "CachedMetadataFileSystemReader and save where you need"
        )
    if os.path.isdir(src) and _is_dcp_dir(src):
        if not os.path.exists(os.path.join(src, _METADATA)):
            raise ConfigurationError(f"{src!r} is not committed (no .metadata); nothing to convert")
        dcp_to_torch_save(src, dst)
        return "dcp -> torch.save"
    from . import _catalog_local
    from .local._manifest import parse_name

    if os.path.isfile(src) and parse_name(os.path.basename(src)):
        torch.save(_catalog_local.load_shard(src), dst)
        return "local shard -> torch.save"
    if os.path.isdir(src) and _catalog_local.is_session_dir(src):
        torch.save(_catalog_local.load_iteration(src), dst)
        return "local checkpoint (newest complete iteration, all ranks) -> torch.save"
    if os.path.isfile(src):
        if os.path.exists(dst) and not os.path.isdir(dst):
            raise ConfigurationError(f"destination {dst!r} exists and is not a directory")
        torch_save_to_dcp(src, dst)
        return "torch.save -> dcp"
    raise ConfigurationError(f"{src!r} is neither a DCP checkpoint directory nor a file")


def bench_defaults(name: str, quick: bool) -> list[str]:
    if name == "async_save":
        return ["--sizes", "64M" if quick else "64M,512M", "--repeats", "3" if quick else "5"]
    return ["--quick"] if quick else []
