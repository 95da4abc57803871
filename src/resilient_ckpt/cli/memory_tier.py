"""The command-line tool's view of a tiered checkpoint's memory tier.

A memory tier root (``TieredCheckpointManager``'s ``memory_dir``) holds one directory per
rank, each with ``step_<N>/`` directories: the rank's own DCP data files, its clique peers'
copies, and the commit record ``.metadata`` (the global DCP metadata with every data file's
size and CRC32). One step is one checkpoint, spread over the rank directories:

* *complete* when a commit record exists and every data file it lists has at least one
  copy of the recorded size in some rank directory (replicas count, as on restore);
* *verified* when, in addition, every copy found was re-read and matched its CRC32: a bad
  copy is a problem to report even though a replica would cover it on restore.

The durable tier needs nothing of its own: each of its steps is a standard DCP checkpoint.
Works without a process group; it only reads files (the memory tier is node-local, so
plain paths). Commit records are read as the tiered restore reads them
(:func:`resilient_ckpt.tiered._restore.record_table`: the restricted unpickler unless
``trusted``, see :mod:`._trust`); a step whose every record is unreadable is *corrupt*,
never complete.
"""

from __future__ import annotations

import os
import zlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import (
    CheckpointingException,
    ConfigurationError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from ..tiered._layout import METADATA_NAME, StepListing, scan_memory
from ..tiered._restore import record_table

_CHUNK = 8 << 20


@dataclass
class MemoryStep:
    step: int
    listings: list[StepListing]
    metadata_path: str | None = None
    table: dict[str, tuple[int, int]] = field(default_factory=dict)
    world_size: int | None = None
    problems: list[str] = field(default_factory=list)
    # The named error of a commit record that could not be read (damaged, or refused by
    # the restricted unpickler), kept when no record of the step could be read.
    error: CheckpointingException | None = None

    @property
    def nbytes(self) -> int:
        return sum(size for listing in self.listings for size in listing.files.values())


def is_memory_root(path: str) -> bool:
    """``path`` holds only rank directories, and some hold ``step_<N>`` directories."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    dirs = [n for n in names if os.path.isdir(os.path.join(path, n))]
    return bool(dirs) and all(d.isdigit() for d in dirs) and bool(scan_memory(path))


def _read_table(metadata_path: str, trusted: bool) -> tuple[dict[str, tuple[int, int]], int | None]:
    """The commit record's file table, and the number of ranks whose files it lists."""
    with open(metadata_path, "rb") as f:
        files = record_table(f.read(), metadata_path, trusted=trusted)
    ranks = {name[2:].split("_", 1)[0] for name in files if name.startswith("__")}
    return files, len(ranks) or None


def steps(memory_dir: str, *, trusted: bool = False) -> list[MemoryStep]:
    """Every step of the memory tier, newest last, with its commit record's file table."""
    by_step: dict[int, list[StepListing]] = defaultdict(list)
    for listing in scan_memory(memory_dir):
        by_step[listing.step].append(listing)
    found = []
    for step, listings in sorted(by_step.items()):
        entry = MemoryStep(step, sorted(listings, key=lambda s: s.owner))
        for listing in entry.listings:
            if not listing.committed:
                continue
            path = os.path.join(listing.path, METADATA_NAME)
            try:
                entry.table, table_ranks = _read_table(path, trusted)
                # A rank whose items were all deduplicated writes no file: count holders too.
                entry.world_size = max(table_ranks or 0, len(entry.listings)) or None
                entry.metadata_path = path
                entry.error = None
                break
            except (CorruptCheckpointError, UnsafeCheckpointError) as exc:
                entry.problems.append(str(exc))
                entry.error = entry.error or exc
            except Exception as exc:  # one unreadable record must not hide the others
                entry.problems.append(f"{path}: unreadable commit record ({exc!r})")
        found.append(entry)
    return found


def _crc32(path: str, progress: Callable[[int], None] | None) -> tuple[int, int]:
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
            if progress is not None:
                progress(len(chunk))
    return size, crc


def check(
    entry: MemoryStep, verify: bool, progress: Callable[[int], None] | None = None
) -> tuple[bool, bool | None, list[str]]:
    """(complete, verified or None when not verifying, problems) of one step."""
    problems = list(entry.problems)
    if entry.metadata_path is None:
        if entry.error is None:
            problems.append(f"step {entry.step}: no commit record in any rank directory")
        return False, False if verify else None, problems
    good: set[str] = set()
    for listing in entry.listings:
        for name, size in sorted(listing.files.items()):
            path = os.path.join(listing.path, name)
            expected = entry.table.get(name)
            if expected is None:
                problems.append(f"{path}: not in the commit record's file table")
                continue
            if size != expected[0]:
                problems.append(f"{path}: {size} bytes, {expected[0]} were written")
                continue
            if verify:
                got = _crc32(path, progress)
                if got != expected:
                    problems.append(
                        f"{path}: CRC32 {got[1]:#010x}, {expected[1]:#010x} was written"
                    )
                    continue
            good.add(name)
    missing = sorted(set(entry.table) - good)
    if missing:
        problems.append(f"step {entry.step}: no valid copy of {', '.join(missing)}")
    complete = not missing and bool(entry.table)
    verified = (complete and not problems) if verify else None
    return complete, verified, problems


def newest_complete(memory_dir: str, *, trusted: bool = False) -> MemoryStep:
    """The newest step ``ls`` lists as complete; if there is none, the named error of the
    newest unreadable record, if any, else a ``ConfigurationError``."""
    found = steps(memory_dir, trusted=trusted)
    for entry in reversed(found):
        if entry.metadata_path is not None and check(entry, verify=False)[0]:
            return entry
    for entry in reversed(found):
        if entry.error is not None:
            raise entry.error
    raise ConfigurationError(f"{memory_dir!r} holds no complete memory-tier checkpoint")


def good_copies(entry: MemoryStep, *, checksums: bool = True) -> tuple[dict[str, str], list[str]]:
    """One copy of each data file of a complete step, of the recorded size and (with
    ``checksums``) CRC32, from any rank directory, as the restore picks one: name -> path;
    and the problems of the step (a bad copy, a file without a good one). A file whose
    every copy fails its checksum gets one of the right size when ``checksums`` is off."""
    chosen: dict[str, str] = {}
    damaged: dict[str, str] = {}
    problems = []
    for listing in entry.listings:
        for name, size in sorted(listing.files.items()):
            expected = entry.table.get(name)
            if name in chosen or expected is None or size != expected[0]:
                continue
            path = os.path.join(listing.path, name)
            got = _crc32(path, None)
            if got == expected:
                chosen[name] = path
                continue
            problems.append(f"{path}: CRC32 {got[1]:#010x}, {expected[1]:#010x} was written")
            damaged.setdefault(name, path)
    if not checksums:
        chosen = {**damaged, **chosen}
    missing = sorted(set(entry.table) - set(chosen))
    if missing:
        problems.append(f"step {entry.step}: no valid copy of {', '.join(missing)}")
    return chosen, problems


def newest_metadata(memory_dir: str, *, trusted: bool = False) -> str:
    """The commit record of the newest complete step (for ``inspect``); if there is none,
    the named error of the newest unreadable record, if any."""
    path = newest_complete(memory_dir, trusted=trusted).metadata_path
    if path is None:  # newest_complete returns only steps with a readable record
        raise ConfigurationError(f"{memory_dir!r} holds no complete memory-tier checkpoint")
    return path


def summarize(
    memory_dir: str,
    verify: bool,
    progress: Callable[[int], None] | None = None,
    *,
    trusted: bool = False,
) -> list[dict[str, Any]]:
    """One record per step: world size, bytes (all copies), complete, verified, problems,
    and whether it is corrupt (no commit record readable) with that named error."""
    records = []
    for entry in steps(memory_dir, trusted=trusted):
        complete, verified, problems = check(entry, verify, progress)
        corrupt = entry.metadata_path is None and entry.error is not None
        records.append(
            {
                "iteration": entry.step,
                "world_size": entry.world_size,
                "nbytes": entry.nbytes,
                "complete": complete,
                "verified": verified,
                "problems": problems,
                "corrupt": corrupt,
                "error": str(entry.error) if corrupt else "",
                "exception": entry.error if corrupt else None,
            }
        )
    return records
