"""Choosing what to restore: the newest verified checkpoint on any tier, the same on every rank.

Discovery is one gather on the library group: every rank reports the memory-tier step
directories it can reach (their data files and sizes, whether committed), the file table
of each committed step it could read, and (the coordinator) the committed durable steps.
Every rank then computes the same ordered candidate list from the same gathered data:

* a memory step is a candidate when some commit record of it was readable and every data
  file of its table has a copy of the right size on some rank's node (own, a peer's on the
  same node, or one another node sends during the load);
* a durable step is a candidate when its ``.metadata`` exists;
* newest first; at equal steps memory before durable (it is faster and as new).

The commit record of a memory step goes from the lowest rank that read it to all (ranks
on a replaced node have none). The manager then tries the candidates in order with
:class:`~._verifying_reader.VerifyingReader`; a candidate
whose files turn out corrupt on every copy makes ``dcp.load`` fail on every rank, and the
next one is tried. Nothing here reads data files: sizes come from directory listings, and
checksums are checked while the data is read for the load itself.

Commit records are unpickled with the restricted unpickler
(:mod:`resilient_ckpt._restricted_pickle`): one that is damaged, empty, of another kind,
or names a global no commit record holds (refused, never run; logged with the file and the
global) makes its step unavailable on this rank, as a missing one does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from .. import _restricted_pickle
from .._logging import get_logger
from ..errors import CheckpointingException, CorruptCheckpointError, UnsafeCheckpointError
from ..storage import get_backend
from ..storage.commit import COMMIT_RECORD
from ..storage.retention import list_checkpoints
from ._layout import (
    METADATA_NAME,
    StepListing,
    memory_step_dir,
    parse_step,
    scan_memory,
    step_name,
)
from ._verifying_reader import VerifyingReader
from ._writes import file_table

logger = get_logger(__name__)

MEMORY, DURABLE = "memory", "durable"


@dataclass
class RankView:
    """What one rank can see, as gathered."""

    listings: list[StepListing] = field(default_factory=list)
    tables: dict[int, dict[str, tuple[int, int]]] = field(default_factory=dict)
    durable_steps: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Candidate:
    step: int
    tier: str


def local_view(memory_dir: str, durable_dir: str, is_coordinator: bool) -> RankView:
    listings = scan_memory(memory_dir)
    view = RankView(listings=listings)
    for listing in sorted(listings, key=lambda s: s.owner):
        if listing.committed and listing.step not in view.tables:
            table = _read_table(os.path.join(listing.path, METADATA_NAME))
            if table:
                view.tables[listing.step] = table
    if is_coordinator:
        try:
            refs = list_checkpoints(durable_dir)
        except Exception as exc:
            logger.warning("cannot list the durable tier %s: %r", durable_dir, exc)
            refs = []
        view.durable_steps = [
            s for r in refs if r.committed and (s := parse_step(r.name)) is not None
        ]
    return view


def record_table(record: bytes, path: str, *, trusted: bool = False) -> dict[str, tuple[int, int]]:
    """The file table of a commit record's bytes (``path`` names it in errors), unpickled
    with the restricted unpickler: a record naming a global that DCP metadata never holds
    is refused (``UnsafeCheckpointError``), never run; a damaged one, or one of another
    kind, is a ``CorruptCheckpointError``. ``trusted`` (the command line's ``--trust``)
    allows every global, with the same errors for a damaged record."""
    metadata = _restricted_pickle.loads(record, path=path, expect=Metadata, trusted=trusted)
    return file_table(metadata, path)


def _unavailable(path: str, exc: Exception) -> None:
    """Log why the commit record at ``path`` makes its step unavailable on this rank."""
    if isinstance(exc, UnsafeCheckpointError):
        logger.warning(
            "refused commit record %s: it names the global %s, which no commit record holds "
            "(nothing was run); its step is treated as unavailable",
            path,
            exc.name,
        )
    else:
        logger.warning("unreadable commit record, its step is treated as unavailable: %s", exc)


def _read_table(path: str) -> dict[str, tuple[int, int]]:
    try:
        with open(path, "rb") as f:
            return record_table(f.read(), path)
    except (OSError, CheckpointingException) as exc:
        _unavailable(path, exc)
        return {}


def candidates(views: list[RankView]) -> list[Candidate]:
    """Every restorable checkpoint, best first (identical on every rank)."""
    found: list[Candidate] = []
    tables: dict[int, dict[str, tuple[int, int]]] = {}
    for view in views:
        for step, table in view.tables.items():
            tables.setdefault(step, table)
    for step, table in tables.items():
        sizes: dict[str, set[int]] = {}
        for view in views:
            for listing in view.listings:
                if listing.step == step:
                    for name, size in listing.files.items():
                        sizes.setdefault(name, set()).add(size)
        missing = [n for n, (size, _) in table.items() if size not in sizes.get(n, set())]
        if missing:
            logger.info("memory step %d is incomplete (no copy of %s)", step, sorted(missing))
            continue
        found.append(Candidate(step, MEMORY))
    for view in views:
        found.extend(Candidate(step, DURABLE) for step in view.durable_steps)
    return sorted(set(found), key=lambda c: (-c.step, c.tier != MEMORY))


def record_holder(views: list[RankView], step: int) -> int | None:
    """The lowest rank that read the commit record of memory step ``step``."""
    return next((rank for rank, view in enumerate(views) if step in view.tables), None)


def read_commit_record(listings: list[StepListing], step: int) -> bytes | None:
    """The bytes of a readable commit record of memory step ``step`` among ``listings``
    (this rank's view of its node)."""
    for listing in listings:
        if listing.step == step and listing.committed:
            path = os.path.join(listing.path, METADATA_NAME)
            try:
                with open(path, "rb") as f:
                    data = f.read()
                if record_table(data, path):
                    return data
            except (OSError, CheckpointingException) as exc:
                _unavailable(path, exc)
    return None


def memory_reader(
    memory_dir: str,
    listings: list[StepListing],
    rank: int,
    step: int,
    record: bytes,
    group: Any,
) -> VerifyingReader:
    """A reader of memory step ``step`` (its commit record ``record``, as shared by the rank
    that read it) from the copies in ``listings`` (this rank's view, own first); the rest
    come from other ranks over ``group`` when the load runs (``_fetch``)."""
    name = f"the commit record of memory step {step}"
    table = record_table(record, name)
    if not table:
        raise CorruptCheckpointError(
            f"rank {rank}: the commit record of memory step {step} has no file table"
        )
    listings = sorted(
        (s for s in listings if s.step == step), key=lambda s: (s.owner != rank, s.owner)
    )
    locations: dict[str, list[str]] = {}
    for listing in listings:
        for name in listing.files:
            locations.setdefault(name, []).append(os.path.join(listing.path, name))
    here = memory_step_dir(memory_dir, rank, step)
    return VerifyingReader(here, record, locations, table, exchange_group=group, metadata_name=name)


def durable_reader(durable_dir: str, step: int) -> VerifyingReader:
    backend = get_backend(durable_dir)
    path = backend.join(durable_dir, step_name(step))
    metadata_path = backend.join(path, COMMIT_RECORD)
    with backend.open_read(metadata_path) as f:
        record = f.read()
    table = record_table(record, metadata_path)
    if not table:
        raise CorruptCheckpointError(
            f"{path!r} has no file table in its commit record (not written by resilient_ckpt); "
            "it cannot be verified",
            path=path,
        )
    locations = {name: [backend.join(path, name)] for name in table}
    return VerifyingReader(path, record, locations, table, metadata_name=metadata_path)
