"""What the command-line tool knows about checkpoints on disk: find, verify, inspect.

Four kinds are recognised by their shape, never by a registry: a *DCP* checkpoint is a
directory holding ``.metadata``, ``__<rank>_<k>.distcp`` files or temporary files of either
(or, empty, named as a checkpoint beside it: see
:func:`~resilient_ckpt.storage.retention.checkpoint_dirs`); a tiered checkpoint's *memory*
tier holds ``<rank>/step_<n>/`` directories (see ``memory_tier``; its durable tier is plain
DCP); a *local* checkpoint root holds ``<session>/<rank>/iter_<n>_<owner>_local.*`` files;
any other ``*.pt`` / ``*.pth`` file is a ``torch.save`` file, and a temporary file of ours
that was to become one (``.<name>.tmp-<pid>@<host>``) is listed as such (kind ``temp``).

*Complete* means what a load needs: the commit record exists and every file it names has
its recorded size (a DCP ``.metadata`` records each file's size, or for plain ``dcp.save``
where its last item ends), judged from the listing, without reading data. *Verified* means
every byte was re-read and checked. What a killed save left is listed, never as complete.

Listing and verification go through the storage backend of the path, so the same walk works
on a local directory and on ``msc://<profile>/<prefix>``: one listing per level (with the
sizes it carries), no per-file calls.

**What is read, and how safely** (see :mod:`._trust`). Listing reads a DCP checkpoint's
``.metadata`` (for its world size) and a memory tier's commit records, through the
restricted unpickler, and looks at a ``torch.save`` file's zip directory or first bytes
(no unpickling). A checkpoint whose commit record or file cannot be read that way is
listed as *corrupt*, never complete, with the named error. ``verify``, ``inspect`` and
``convert`` load user state with ``weights_only=True``; ``trusted=True`` (the command's
``--trust``) unpickles in full.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from ..errors import (
    CheckpointingException,
    ConfigurationError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from ..storage import PosixBackend, StorageBackend, get_backend
from ..storage.base import Listing, is_msc_url
from ..storage.commit import (
    COMMIT_RECORD,
    RecordCommit,
    TempName,
    is_committed_listing,
    parse_temp_name,
)
from ..storage.retention import checkpoint_dirs, is_dcp_listing
from . import _trust
from ._dcp_metadata import read_dcp_metadata

__all__ = [
    "Entry",
    "Report",
    "discover",
    "inspect",
    "is_dcp_dir",
    "load_file",
    "not_a_checkpoint",
    "read_dcp_metadata",
    "torch_file_problem",
    "total_bytes",
    "verify_all",
    "verify_dcp",
]

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
    # A file that says what the checkpoint is could not be read: damaged (empty, cut
    # short, garbage, of the wrong kind) or refused as unsafe. Never complete.
    corrupt: bool = False
    # The one-line named error of a file that could not be read at all (corrupt, or a
    # torch file refused when verifying it); the command prints it and exits 2.
    error: str = ""
    exc: BaseException | None = field(default=None, repr=False)  # that error, for --debug
    # A DCP checkpoint's commit record exists (None for other kinds): committed and not
    # complete is a checkpoint whose files do not match its record, a damaged one.
    committed: bool | None = None

    def as_dict(self) -> dict[str, Any]:
        return _as_dict(self)

    def mark_corrupt(self, exc: CheckpointingException) -> None:
        self.complete, self.corrupt, self.error, self.exc = False, True, str(exc), exc
        self.problems = [*self.problems, str(exc)]

    def mark_refused(self, exc: CheckpointingException) -> None:
        self.verified, self.problems, self.error, self.exc = False, [str(exc)], str(exc), exc


def _as_dict(record: Any) -> dict[str, Any]:
    return {f.name: getattr(record, f.name) for f in fields(record) if f.name != "exc"}


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
    corrupt: bool = False  # as in Entry
    error: str = ""
    exc: BaseException | None = field(default=None, repr=False)

    def as_dict(self) -> dict[str, Any]:
        return _as_dict(self)


def is_dcp_dir(path: str) -> bool:
    backend = get_backend(path)
    return backend.is_dir(path) and is_dcp_listing(backend.scan(path))


def _iteration_of(path: str) -> int | None:
    digits = "".join(c if c.isdigit() else " " for c in os.path.basename(path.rstrip("/")))
    numbers = digits.split()
    return int(numbers[-1]) if numbers else None


def _dcp_entry(
    path: str, listing: Listing, verify: bool, progress: Progress | None, trusted: bool
) -> Entry:
    committed = is_committed_listing(listing)
    nbytes = sum(listing.files.values())
    entry = Entry("dcp", path, _iteration_of(path), nbytes=nbytes, complete=committed)
    entry.committed = committed
    if not committed:
        entry.problems = [_uncommitted_problem(listing)]
        entry.verified = False if verify else None
        return entry
    try:
        metadata = read_dcp_metadata(path, trusted=trusted)
        entry.world_size = _dcp_world_size(metadata)
        sizes = _size_problems(path, metadata, listing)
    except (CorruptCheckpointError, UnsafeCheckpointError) as exc:
        entry.mark_corrupt(exc)
        entry.verified = False if verify else None
        return entry
    except (OSError, CheckpointingException):
        sizes = []  # storage trouble: verify says more; listing goes on
    if sizes:  # committed, but a file is missing or cut short: no checkpoint to load
        entry.complete, entry.problems = False, sizes
    if verify:
        report = verify_dcp(path, progress, trusted=trusted)
        entry.verified, entry.problems, entry.checks = report.ok, report.problems, report.checks
        entry.error, entry.exc = report.error, report.exc
        if report.corrupt:
            entry.complete, entry.corrupt = False, True
    return entry


# The first words of every problem of a checkpoint without its commit record.
NOT_COMMITTED = "not committed (incomplete)"


def _uncommitted_problem(listing: Listing) -> str:
    temporary = [n for n in listing.files if parse_temp_name(n) is not None]
    if not listing.files:
        held = "it is empty"
    elif len(temporary) == len(listing.files):
        held = f"it holds only temporary files ({len(temporary)})"
    else:
        held = "it holds data files"
    return (
        f"{NOT_COMMITTED}: no {COMMIT_RECORD}, {held}: a save in progress, or one that was "
        "interrupted (prune removes it once a newer checkpoint is committed)"
    )


def _size_problems(path: str, metadata: Any, listing: Listing) -> list[str]:
    """The committed checkpoint's files against the sizes its metadata records, from the
    listing (no data read)."""
    from ..async_ckpt.verify import size_problems

    try:
        return [f"{path}/{p}" for p in size_problems(metadata, listing.files)]
    except CorruptCheckpointError as exc:
        record = os.path.join(path, COMMIT_RECORD)
        raise CorruptCheckpointError(f"{record}: {exc}", path=record) from exc


def _dcp_world_size(metadata: Any) -> int | None:
    ranks = set()
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", "")
        if name.startswith("__") and "_" in name[2:]:
            ranks.add(name[2:].split("_", 1)[0])
    return len(ranks) or None


def verify_dcp(path: str, progress: Progress | None = None, *, trusted: bool = False) -> Report:
    """Check the committed DCP checkpoint at ``path``. Its ``.metadata`` is read here first,
    restricted unless ``trusted``, before anything else unpickles it: a damaged or refused
    one makes the report corrupt, with the named error."""
    from ..async_ckpt.verify import verify_checkpoint

    try:
        read_dcp_metadata(path, trusted=trusted)
    except (CorruptCheckpointError, UnsafeCheckpointError) as exc:
        return Report("dcp", path, False, [str(exc)], corrupt=True, error=str(exc), exc=exc)
    except (OSError, CheckpointingException):
        pass  # missing or unreadable: verify_checkpoint says which
    try:
        result = verify_checkpoint(path, progress=progress, trusted=trusted)
    except CheckpointingException as exc:
        lines = str(exc).splitlines()
        return Report("dcp", path, False, [line.strip() for line in lines[1:]] or lines)
    if result.checksummed:
        return Report("dcp", path, True, [], result.nbytes, checks="crc32")
    # No checksums recorded (a plain dcp.save): sizes were checked; reading every item back
    # catches what sizes cannot (a truncated or garbled pickle, an unreadable tensor).
    from . import conversion

    try:
        conversion.load_dcp(path, progress, trusted=trusted)
    except UnsafeCheckpointError as exc:  # not damage: an item this load may not unpickle
        return Report("dcp", path, False, [str(exc)], checks="read", error=str(exc), exc=exc)
    except BaseException as exc:  # CheckpointException derives from BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return Report("dcp", path, False, [f"reading the items back failed: {exc}"], checks="read")
    return Report("dcp", path, True, [], result.nbytes, checks="read")


def discover(
    root: str, verify: bool = False, progress: Progress | None = None, *, trusted: bool = False
) -> list[Entry]:
    """Every checkpoint at or under ``root``; with ``verify``, each one checked (user state
    loaded safely unless ``trusted``)."""
    backend = get_backend(root)
    if not backend.exists(root):
        raise ConfigurationError(f"{root!r} does not exist")
    if not backend.is_dir(root):
        temp = _torch_temp(os.path.basename(root))
        if temp is not None:
            return [_temp_entry(root, temp, backend.size(root), verify)]
        return [_file_entry(root, backend.size(root), verify, progress, trusted)]
    entries: list[Entry] = []
    _walk(backend, root, verify, progress, trusted, entries)
    return sorted(entries, key=lambda e: (e.path, e.iteration or 0))


def _walk(
    backend: StorageBackend,
    path: str,
    verify: bool,
    progress: Progress | None,
    trusted: bool,
    entries: list[Entry],
    listing: Listing | None = None,
) -> None:
    listing = backend.scan(path) if listing is None else listing
    if is_dcp_listing(listing):
        entries.append(_dcp_entry(path, listing, verify, progress, trusted))
        return
    memory = _memory_entries(backend, path, verify, progress, trusted)
    if memory is not None:
        entries.extend(memory)
        return
    local = _local_entries(backend, path, listing, verify, progress)
    if local is not None:
        entries.extend(local)
        return
    for name in sorted(listing.files):
        full = backend.join(path, name)
        temp = _torch_temp(name)
        if temp is not None:
            entries.append(_temp_entry(full, temp, listing.files[name], verify))
        elif name.endswith(TORCH_SUFFIXES) and not name.startswith("."):
            entries.append(_file_entry(full, listing.files[name], verify, progress, trusted))
    children = {name: backend.scan(backend.join(path, name)) for name in listing.dirs}
    # An empty directory named as a checkpoint beside it is one: a save killed before
    # its first file.
    dcp = checkpoint_dirs(children)
    for name, child in sorted(children.items()):
        full = backend.join(path, name)
        if name in dcp and not is_dcp_listing(child):
            entries.append(_dcp_entry(full, child, verify, progress, trusted))
        else:
            _walk(backend, full, verify, progress, trusted, entries, child)


TORCH_SUFFIXES = (".pt", ".pth")


def _torch_temp(name: str) -> TempName | None:
    """What a temporary file of ours (:func:`~resilient_ckpt.storage.commit.temp_name`)
    that was to become a ``torch.save`` file says; None for any other name."""
    parsed = parse_temp_name(name)
    return parsed if parsed is not None and parsed.final.endswith(TORCH_SUFFIXES) else None


def _temp_entry(path: str, parsed: TempName, nbytes: int, verify: bool) -> Entry:
    """A save in progress, or one whose writer was killed: incomplete, saying which."""
    if parsed.writer_gone():
        writer = (
            f"writer pid {parsed.pid} on this host is gone: the next TorchAsyncCheckpoint "
            "save into this directory removes it"
        )
    elif parsed.host is None:
        writer = f"writer pid {parsed.pid}, host not recorded"
    else:
        writer = f"writer pid {parsed.pid} on host {parsed.host}"
    return Entry(
        "temp",
        path,
        _iteration_of(parsed.final),
        nbytes=nbytes,
        complete=False,
        verified=False if verify else None,
        problems=[f"temporary file of an unfinished save of {parsed.final} ({writer})"],
    )


def _file_entry(
    path: str, nbytes: int, verify: bool, progress: Progress | None, trusted: bool
) -> Entry:
    from ..local._manifest import DATA, parse_name

    parsed = parse_name(os.path.basename(path))
    if parsed is not None and parsed[2] == DATA and not is_msc_url(path):
        return _shard_entry(path, parsed[0], nbytes, verify, progress)
    entry = Entry("torch", path, _iteration_of(path), nbytes=nbytes)
    problem = None if is_msc_url(path) else torch_file_problem(path)
    if problem is not None:
        entry.mark_corrupt(CorruptCheckpointError(f"{path}: {problem}", path=path))
        entry.verified = False if verify else None
        return entry
    if verify:
        entry.checks = "load"
        try:
            load_file(path, progress, trusted=trusted)
            entry.verified = True
        except CorruptCheckpointError as exc:
            entry.mark_corrupt(exc)
            entry.verified = False
        except CheckpointingException as exc:  # refused: a global the safe load may not run
            entry.mark_refused(exc)
    return entry


def _shard_entry(
    path: str, iteration: int, nbytes: int, verify: bool, progress: Progress | None
) -> Entry:
    """A local checkpoint copy file met on its own (not in a session directory): verified
    by its checksums, never unpickled."""
    from . import local_checkpoints

    entry = Entry("local", path, iteration, nbytes=nbytes)
    problem = local_checkpoints.shard_problem(path)
    if problem is not None:
        entry.complete, entry.problems = False, [problem]
    if verify:
        entry.checks = "crc32"
        try:
            local_checkpoints.verify_shard(path)
            entry.verified = True
        except CheckpointingException as exc:
            entry.verified, entry.problems = False, [str(exc)]
        if progress is not None:
            progress(nbytes)
    return entry


# A torch.save file is a zip archive, or (the legacy format) starts with the pickle of this
# magic number: with protocol 2 and later, a pickle starts with the byte 0x80.
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_HEADS = (b"\x80", *(pickle.dumps(_LEGACY_MAGIC, protocol=p)[:8] for p in (0, 1)))
_ZIP_MAGIC = b"PK\x03\x04"


def torch_file_problem(path: str) -> str | None:
    """What makes the local file at ``path`` no ``torch.save`` file, judged from its zip
    directory or first bytes without unpickling anything; None when it may be one."""
    if os.path.getsize(path) == 0:
        return "is empty"
    with open(path, "rb") as f:
        head = f.read(16)
    if head.startswith(_ZIP_MAGIC):
        try:
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
        except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError) as exc:
            return f"is truncated or damaged: its zip directory cannot be read ({exc})"
        if not any(n == "data.pkl" or n.endswith("/data.pkl") for n in names):
            return "is a zip archive but not a torch.save file (no data.pkl record)"
        return None
    if head.startswith(_LEGACY_HEADS):
        return None
    return "not a torch.save file (neither a zip archive nor torch's legacy format)"


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
    backend: StorageBackend, path: str, verify: bool, progress: Progress | None, trusted: bool
) -> list[Entry] | None:
    from . import memory_tier

    # The memory tier is node-local RAM: plain paths only.
    if not isinstance(backend, PosixBackend) or not memory_tier.is_memory_root(path):
        return None
    rows = memory_tier.summarize(path, verify, progress, trusted=trusted)
    return _rows_as_entries("memory", path, verify, rows)


def total_bytes(path: str) -> int:
    """What ``verify_all`` reads, to size a progress bar (listing only)."""
    backend = get_backend(path)
    if backend.exists(path) and not backend.is_dir(path):
        return backend.size(path)
    return sum(e.nbytes for e in discover(path))


def verify_all(
    path: str, progress: Progress | None = None, *, trusted: bool = False
) -> list[Report]:
    """A report for every checkpoint at or under ``path`` (user state loaded safely unless
    ``trusted``)."""
    return [
        Report(
            e.kind,
            e.path,
            bool(e.verified) and e.complete,
            # Every incomplete kind but a local checkpoint says itself why (no commit
            # record, a file cut short, a data file without a valid copy, the error).
            e.problems if e.complete or e.problems else [NOT_COMMITTED],
            e.nbytes,
            e.checks,
            e.corrupt,
            e.error,
            e.exc,
        )
        for e in discover(path, verify=True, progress=progress, trusted=trusted)
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


def inspect(path: str, *, trusted: bool = False) -> list[dict[str, Any]]:
    """Every tensor's key, dtype, shape and size. A DCP checkpoint (or a memory tier) is
    described from its metadata alone; a file or a local checkpoint is loaded, safely unless
    ``trusted`` (a local checkpoint's state only when ``trusted``)."""
    out: list[dict[str, Any]] = []
    backend = get_backend(path)
    if is_dcp_dir(path):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        if not RecordCommit(backend, path).is_committed():
            raise ConfigurationError(f"{path!r} is not committed (no .metadata); nothing to show")
        metadata = read_dcp_metadata(path, trusted=trusted)
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
    if not backend.exists(path):
        raise ConfigurationError(f"{path!r} does not exist")
    if not backend.is_dir(path):
        _describe("", load_file(path, trusted=trusted), out)
        return out
    from . import local_checkpoints, memory_tier

    if local_checkpoints.is_session_dir(path):
        _describe("", local_checkpoints.load_iteration(path, trusted=trusted), out)
        return out
    if memory_tier.is_memory_root(path):
        # Every step directory's commit record is the global metadata: the newest will do.
        newest = memory_tier.newest_metadata(path, trusted=trusted)
        return inspect(os.path.dirname(newest), trusted=trusted)
    raise not_a_checkpoint(path)


def not_a_checkpoint(path: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{path}: not a checkpoint (no DCP checkpoint, tiered memory tier or local checkpoint "
        "session: a DCP checkpoint directory holds .metadata and __<rank>_<k>.distcp files)",
        path=path,
    )


def load_file(path: str, progress: Progress | None = None, *, trusted: bool = False) -> Any:
    from ..local._manifest import parse_name
    from . import conversion, local_checkpoints

    if is_msc_url(path):
        backend = get_backend(path)
        with backend.open_read(path) as f:
            return _trust.torch_load(f, path=path, trusted=trusted)
    if parse_name(os.path.basename(path)):
        shard = local_checkpoints.load_shard(path, trusted=trusted)
        if progress is not None:
            progress(os.path.getsize(path))
        return shard
    problem = torch_file_problem(path)
    if problem is not None:
        raise CorruptCheckpointError(f"{path}: {problem}", path=path)
    return conversion.load_file(path, progress, trusted=trusted)


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
            r.get("corrupt", False),
            r.get("error", ""),
            r.get("exception"),
        )
        for r in rows
    ]
