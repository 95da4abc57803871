"""What the command-line tool knows about checkpoints on disk: find, verify, inspect, convert.

Three kinds are recognised by their shape, never by a registry: a *DCP* checkpoint is a
directory holding ``.metadata`` (complete) or only ``__<rank>_<k>.distcp`` files
(incomplete: never committed); a *local* checkpoint root holds
``<session>/<rank>/iter_<n>_<owner>_local.*`` files; any other ``*.pt`` / ``*.pth`` file is a
``torch.save`` file.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .errors import CheckpointingException, ConfigurationError

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
    try:
        names = os.listdir(path)
    except (NotADirectoryError, FileNotFoundError, PermissionError):
        return False
    return _METADATA in names or any(n.endswith(".distcp") for n in names)


def _dir_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(path, n))
        for n in os.listdir(path)
        if os.path.isfile(os.path.join(path, n))
    )


def _iteration_of(path: str) -> int | None:
    digits = "".join(c if c.isdigit() else " " for c in os.path.basename(path.rstrip("/")))
    numbers = digits.split()
    return int(numbers[-1]) if numbers else None


def _dcp_entry(path: str, verify: bool) -> Entry:
    complete = os.path.exists(os.path.join(path, _METADATA))
    entry = Entry("dcp", path, _iteration_of(path), nbytes=_dir_bytes(path), complete=complete)
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
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(path).read_metadata()


def verify_dcp(path: str) -> Report:
    from .async_ckpt.verify import verify_checkpoint

    try:
        result = verify_checkpoint(path)
    except CheckpointingException as exc:
        lines = str(exc).splitlines()
        return Report("dcp", path, False, [line.strip() for line in lines[1:]] or lines)
    return Report("dcp", path, True, [], result.nbytes)


def discover(root: str, verify: bool = False) -> list[Entry]:
    if not os.path.exists(root):
        raise ConfigurationError(f"{root!r} does not exist")
    entries: list[Entry] = []
    if os.path.isfile(root):
        return [Entry("torch", root, _iteration_of(root), nbytes=os.path.getsize(root))]
    for dirpath, dirnames, filenames in os.walk(root):
        if _is_dcp_dir(dirpath):
            entries.append(_dcp_entry(dirpath, verify))
            dirnames[:] = []
            continue
        local = _local_entries(dirpath, verify)
        if local is not None:
            entries.extend(local)
            dirnames[:] = []
            continue
        for name in sorted(filenames):
            if name.endswith((".pt", ".pth")) and not name.startswith("."):
                full = os.path.join(dirpath, name)
                entries.append(
                    Entry("torch", full, _iteration_of(full), nbytes=os.path.getsize(full))
                )
        dirnames.sort()
    return sorted(entries, key=lambda e: (e.path, e.iteration or 0))


def _local_entries(path: str, verify: bool) -> list[Entry] | None:
    from . import _catalog_local

    if not _catalog_local.is_session_dir(path):
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
        for r in _catalog_local.summarize(path, verify)
    ]


def verify_all(path: str, progress: bool = True) -> list[Report]:
    if os.path.isfile(path):
        try:
            _load_file(path)
        except Exception as exc:  # any load failure is a verification failure
            return [Report("torch", path, False, [f"torch.load failed: {exc}"])]
        return [Report("torch", path, True, [], os.path.getsize(path))]
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
    if os.path.isdir(path) and _is_dcp_dir(path):
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
    if os.path.isfile(path):
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

    if parse_name(os.path.basename(path)):
        return _catalog_local.load_shard(path)
    return torch.load(path, map_location="cpu", weights_only=False)


def convert(src: str, dst: str) -> str:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

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
