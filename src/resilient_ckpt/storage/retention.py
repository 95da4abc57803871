"""Listing and retention of DCP checkpoints below a root, on any storage backend.

A root holds one checkpoint per sub-directory (``<root>/iteration-0010/``, as the writer is
pointed at). A checkpoint is *committed* when its commit record ``.metadata`` exists; its
order is the last number in its name (the iteration), then the name. A sub-directory is a
checkpoint when it holds the record, a data file (``*.distcp``) or the temporary file of one
(a save killed before any file was renamed leaves only those): :func:`is_dcp_listing`; and
when it is empty and named as such a sibling is, but for its numbers (a save killed between
creating its directory and opening its first file): :func:`checkpoint_dirs`.

Retention keeps the newest ``keep_latest`` committed checkpoints and deletes older ones only
once a newer one is committed. A checkpoint without its commit record that is newer than
the newest committed one may be a save in progress, so it is never touched; an uncommitted
one older than that is a failed save, and goes. Deleting is
:meth:`~.commit.RecordCommit.discard`: the commit record first, then the data.

Resuming: :func:`latest_checkpoint` is the newest committed checkpoint below a root, DCP
directory or ``torch.save`` file (a file under its final name is complete: it is renamed
there only once written).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .._logging import get_logger
from ..errors import ConfigurationError
from .backends import get_backend
from .base import Listing
from .commit import COMMIT_RECORD, RecordCommit, is_committed_listing, parse_temp_name

logger = get_logger(__name__)

__all__ = ["CheckpointRef", "latest_checkpoint", "list_checkpoints", "prune_checkpoints"]

_DATA_SUFFIX = ".distcp"
_TORCH_SUFFIXES = (".pt", ".pth")


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


def is_dcp_listing(listing: Listing) -> bool:
    """Whether a directory's listing is a DCP checkpoint's, committed or not: it holds the
    commit record, a data file, or a temporary file of either."""
    if is_committed_listing(listing):
        return True
    for name in listing.files:
        parsed = parse_temp_name(name)
        final = parsed.final if parsed is not None else name
        if final.endswith(_DATA_SUFFIX) or final == COMMIT_RECORD:
            return True
    return False


def _shape(name: str) -> str:
    return re.sub(r"\d+", "#", name)


def checkpoint_dirs(listings: dict[str, Listing]) -> dict[str, bool]:
    """Which of a root's sub-directories (name -> its listing) are DCP checkpoints, and
    whether each is committed (see the module docstring)."""
    found = {n: is_committed_listing(lst) for n, lst in listings.items() if is_dcp_listing(lst)}
    shapes = {_shape(n) for n in found}
    for name, listing in listings.items():
        empty = not listing.files and not listing.dirs
        if name not in found and empty and _shape(name) in shapes:
            found[name] = False
    return found


def _order(ref: CheckpointRef) -> tuple[int, str]:
    return (ref.iteration if ref.iteration is not None else -1, ref.name)


def list_checkpoints(root: str, *, use_msc: bool = False) -> list[CheckpointRef]:
    """DCP checkpoints directly below ``root``, oldest first (committed or not)."""
    backend = get_backend(root, use_msc=use_msc)
    listings = {name: backend.scan(backend.join(root, name)) for name in backend.scan(root).dirs}
    refs = [
        CheckpointRef(backend.join(root, name), name, _iteration(name), committed)
        for name, committed in checkpoint_dirs(listings).items()
    ]
    return sorted(refs, key=_order)


def latest_checkpoint(root: str, *, use_msc: bool = False) -> str | None:
    """The newest committed checkpoint directly below ``root``: a committed DCP checkpoint
    directory or a ``torch.save`` file (``*.pt``, ``*.pth``; hidden temporary files are
    never one), the one with the highest iteration (the last number in its name); None if
    there is none. Works on any backend, without a process group.

    A save that was killed leaves an uncommitted directory or a temporary file; neither is
    returned, so resuming from what this returns never loads a torn checkpoint.
    """
    backend = get_backend(root, use_msc=use_msc)
    found = [r for r in list_checkpoints(root, use_msc=use_msc) if r.committed]
    for name in backend.scan(root).files:
        if name.endswith(_TORCH_SUFFIXES) and not name.startswith("."):
            found.append(CheckpointRef(backend.join(root, name), name, _iteration(name), True))
    return max(found, key=_order).path if found else None


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
