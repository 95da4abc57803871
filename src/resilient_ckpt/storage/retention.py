"""Listing and retention of DCP checkpoints below a root, on any storage backend.

A root holds one checkpoint per sub-directory (``<root>/iteration-0010/``, as the writer is
pointed at). A checkpoint is *committed* when its commit record ``.metadata`` exists; its
order is the last number in its name (the iteration), then the name.

Retention keeps the newest ``keep_latest`` committed checkpoints and deletes older ones only
once a newer one is committed. A checkpoint without its commit record that is newer than
the newest committed one may be a save in progress, so it is never touched; an uncommitted
one older than that is a failed save, and goes. Deleting is
:meth:`~.commit.RecordCommit.discard`: the commit record first, then the data.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .._logging import get_logger
from ..errors import ConfigurationError
from .backends import get_backend
from .commit import RecordCommit, is_committed_listing

logger = get_logger(__name__)

__all__ = ["CheckpointRef", "list_checkpoints", "prune_checkpoints"]


@dataclass(frozen=True)
class CheckpointRef:
    """One checkpoint directory below a root."""

    path: str
    name: str
    iteration: int | None
    committed: bool


def _iteration(name: str) -> int | None:
    numbers = re.findall(r"\d+", name)
    return int(numbers[-1]) if numbers else None


def list_checkpoints(root: str, *, use_msc: bool = False) -> list[CheckpointRef]:
    """DCP checkpoints directly below ``root``, oldest first (committed or not)."""
    backend = get_backend(root, use_msc=use_msc)
    refs = []
    for name in backend.scan(root).dirs:
        path = backend.join(root, name)
        listing = backend.scan(path)
        committed = is_committed_listing(listing)
        if committed or any(n.endswith(".distcp") for n in listing.files):
            refs.append(CheckpointRef(path, name, _iteration(name), committed))
    return sorted(refs, key=lambda r: (r.iteration if r.iteration is not None else -1, r.name))


def prune_checkpoints(
    root: str, keep_latest: int = 1, *, use_msc: bool = False, dry_run: bool = False
) -> list[str]:
    """Apply retention below ``root`` (see the module docstring); return what was deleted
    (with ``dry_run``: what would be, deleting nothing)."""
    if not isinstance(keep_latest, int) or isinstance(keep_latest, bool) or keep_latest < 1:
        raise ConfigurationError(f"keep_latest must be an int >= 1, got {keep_latest!r}")
    backend = get_backend(root, use_msc=use_msc)
    refs = list_checkpoints(root, use_msc=use_msc)
    committed = [i for i, r in enumerate(refs) if r.committed]
    if not committed:
        return []
    keep = set(committed[-keep_latest:])
    newest = committed[-1]
    doomed = [r for i, r in enumerate(refs) if i < newest and i not in keep]
    for ref in [] if dry_run else doomed:
        logger.info("retention keeps the newest %d: deleting %s", keep_latest, ref.path)
        RecordCommit(backend, ref.path).discard()
    return [ref.path for ref in doomed]
