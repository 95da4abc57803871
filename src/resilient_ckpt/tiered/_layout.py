"""Where each tier keeps its checkpoints, and how a step directory is recognised.

Memory tier (node-local RAM, e.g. ``/dev/shm/<job>``)::

    <memory_dir>/<rank>/step_<N:09d>/__<rank>_<k>.distcp     this rank's DCP data file(s)
                                    /__<peer>_<k>.distcp     copies of its clique peers' files
                                    /.metadata               commit record (global DCP Metadata)

DCP data file names carry the rank that wrote them, so a rank's own files and its peers'
copies live side by side without renaming, and any rank directory that holds a file can
serve it to DCP's reader unchanged. The commit record is the same global ``Metadata`` in
every rank directory (with each data file's size and CRC32), written only after every rank
and every replica reported success, so a step with a ``.metadata`` anywhere is complete.

Durable tier: ``<durable_dir>/step_<N:09d>/`` is a standard DCP checkpoint (torch's own
reader loads it); its ``.metadata`` is written last by the coordinator.

Step directories are zero-padded so a plain listing sorts by step; the step is parsed back
from the name, never from a file's content.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass

from .._logging import get_logger

logger = get_logger(__name__)

METADATA_NAME = ".metadata"
_STEP_RE = re.compile(r"^step_(\d+)$")


def step_name(step: int) -> str:
    return f"step_{step:09d}"


def parse_step(name: str) -> int | None:
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def rank_dir(memory_dir: str, rank: int) -> str:
    return os.path.join(memory_dir, str(rank))


def memory_step_dir(memory_dir: str, rank: int, step: int) -> str:
    return os.path.join(rank_dir(memory_dir, rank), step_name(step))


@dataclass(frozen=True)
class StepListing:
    """What one reachable memory step directory holds."""

    owner: int  # the rank whose directory it is
    step: int
    path: str
    files: dict[str, int]  # data file name -> size
    committed: bool


def scan_memory(memory_dir: str) -> list[StepListing]:
    """Every step directory of every rank directory reachable from this process.

    On one host every rank's directory is reachable; in a multi-node job, those of the
    ranks on this node (``memory_dir`` is node-local).
    """
    listings: list[StepListing] = []
    try:
        owners = [int(n) for n in os.listdir(memory_dir) if n.isdigit()]
    except FileNotFoundError:
        return listings
    for owner in sorted(owners):
        base = rank_dir(memory_dir, owner)
        try:
            names = os.listdir(base)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for name in names:
            step = parse_step(name)
            if step is None:
                continue
            path = os.path.join(base, name)
            files: dict[str, int] = {}
            committed = False
            try:
                for entry in os.scandir(path):
                    if entry.name == METADATA_NAME:
                        committed = True
                    elif entry.name.endswith(".distcp") and entry.is_file():
                        files[entry.name] = entry.stat().st_size
            except (FileNotFoundError, NotADirectoryError):
                continue
            listings.append(StepListing(owner, step, path, files, committed))
    return listings


def own_steps(memory_dir: str, rank: int) -> dict[int, bool]:
    """``{step: committed}`` of this rank's own memory directory."""
    return {s.step: s.committed for s in scan_memory_owner(memory_dir, rank)}


def scan_memory_owner(memory_dir: str, rank: int) -> list[StepListing]:
    base = rank_dir(memory_dir, rank)
    result: list[StepListing] = []
    try:
        names = os.listdir(base)
    except FileNotFoundError:
        return result
    for name in names:
        step = parse_step(name)
        if step is None:
            continue
        path = os.path.join(base, name)
        committed = os.path.exists(os.path.join(path, METADATA_NAME))
        result.append(StepListing(rank, step, path, {}, committed))
    return result


def remove_step(path: str) -> None:
    """Delete a step directory: the commit record first, so it turns invisible at once."""
    try:
        os.unlink(os.path.join(path, METADATA_NAME))
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("could not remove the commit record of %s: %r", path, exc)
    shutil.rmtree(path, ignore_errors=True)


def prune_memory(memory_dir: str, rank: int, keep: int, world_size: int) -> list[int]:
    """Retention of this rank's memory directory: keep the newest ``keep`` committed steps;
    delete older ones, and uncommitted steps older than the newest commit (failed saves).
    Steps newer than the newest commit may be saves in progress and are left alone.

    After an elastic restore to fewer ranks, the directories of departed ranks (``owner >=
    world_size``) still hold the step restored from; rank ``owner % world_size`` applies the
    same rule to them, counting their commits with its own, so they go once ``keep`` newer
    steps are committed.
    """
    owners = [rank] + [o for o in _owners(memory_dir) if o >= world_size and o % world_size == rank]
    steps = {owner: own_steps(memory_dir, owner) for owner in owners}
    committed = sorted({s for per in steps.values() for s, c in per.items() if c})
    if not committed:
        return []
    kept = set(committed[-keep:])
    doomed = []
    for owner, per in steps.items():
        for step in sorted(per):
            if step < committed[-1] and step not in kept:
                remove_step(memory_step_dir(memory_dir, owner, step))
                doomed.append(step)
    if doomed:
        logger.info("memory tier retention (keep %d): removed steps %s", keep, sorted(doomed))
    return doomed


def _owners(memory_dir: str) -> list[int]:
    try:
        return sorted(int(n) for n in os.listdir(memory_dir) if n.isdigit())
    except FileNotFoundError:
        return []


def purge_newer(memory_dir: str, rank: int, step: int) -> list[int]:
    """Remove this rank's memory steps newer than ``step`` (an abandoned timeline)."""
    doomed = [s for s in own_steps(memory_dir, rank) if s > step]
    for s in doomed:
        remove_step(memory_step_dir(memory_dir, rank, s))
    return doomed
