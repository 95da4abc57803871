"""The commit: how written bytes become a checkpoint that readers may trust, and stop being one.

A checkpoint is never modified in place. Its bytes are written where no reader looks, made
durable, and then published by one atomic step, the *commit*; readers trust only what is
committed, so a crash at any moment leaves the previous state or the new one, never a torn
mix. Three objects here say how, and every writer uses them (the DCP writer, local
checkpoints, retention, ``torch.save`` targets) instead of its own renames:

* :func:`atomic_file` publishes **one file** on a POSIX file system: written under a hidden
  temporary name in the same directory, flushed and fsynced, renamed over the final name,
  and the directory fsynced so the rename survives a crash. It is the POSIX backend's
  ``open_write``, so every artifact the backend writes is all-or-nothing. The temporary
  name carries the writer's pid and host (:func:`temp_name`): a file left by a writer
  killed mid-write can be told from one still being written, and removed
  (:func:`remove_stale_temp_files`); nothing else is ever removed by that name.
* :class:`RenameCommit` publishes **a batch of files** already written under temporary
  names (possibly by another process): one rename each, then one directory fsync for the
  whole batch. Local checkpoints commit an iteration's copies this way.
* :class:`RecordCommit` commits **a checkpoint directory** by its *commit record*, written
  last, after every data file succeeded; a directory without it is no checkpoint.
  ``uncommit`` removes the record durably (first, whenever a committed directory is to be
  rewritten or deleted), so nobody loads a directory whose files are changing. The record
  goes through the storage backend, which gives the two variants:

  - POSIX: the record is an :func:`atomic_file` (temporary name, fsync, rename, directory
    fsync); uncommit unlinks it and fsyncs the directory.
  - Object stores: there is no rename, but an upload is atomic (the object appears whole or
    not at all), so the record is a *marker object written last*, and a completed delete is
    durable. Readers treat a prefix without the marker as absent.

  The backend decides what durable means (``open_write(sync=)``, ``delete(sync=)``): no
  caller branches on the backend's type.

Alternatives: a temporary *directory* renamed into place (orbax's rename variant) needs a
directory rename, which object stores lack and which would move every rank's files at
once; a commit record works on both and lets each rank write its own files in place.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, BinaryIO

from ..errors import StorageError

if TYPE_CHECKING:
    from .base import Listing, StorageBackend

COMMIT_RECORD = ".metadata"
"""The commit record of a DCP checkpoint directory (DCP's own metadata file)."""


def fsync_dir(path: str) -> None:
    """fsync a directory so a rename or unlink inside it survives a crash."""
    fd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _host_tag() -> str:
    """This host's name as it goes into a temporary name: only characters that need no
    quoting, never ``/``."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())
    return name or "unknown-host"


def temp_name(path: str) -> str:
    """A hidden name next to ``path``, unique to this process on this host:
    ``.<name>.tmp-<pid>@<host>``. The writer's pid and host are in the name so that a later
    process can tell a file whose writer is gone (:func:`stale_temp_files`) from one that
    is still being written."""
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.tmp-{os.getpid()}@{_host_tag()}")


# temp_name's pattern; the host is absent in names written before it was added.
_TEMP_NAME = re.compile(r"\.(?P<final>.+)\.tmp-(?P<pid>[0-9]+)(?:@(?P<host>[A-Za-z0-9._-]+))?")


@dataclass(frozen=True)
class TempName:
    """What a temporary name of :func:`temp_name` says: the file it was to become, and its
    writer (``host`` is None in names without one, written by earlier versions)."""

    final: str
    pid: int
    host: str | None

    def writer_gone(self) -> bool:
        """The writer ran on this host and no process has its pid now. False wherever that
        cannot be known (another host, no host in the name, a pid in use again)."""
        if self.host != _host_tag():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except OSError:  # EPERM: a process of another user has that pid
            return False
        return _is_zombie(self.pid)


def _is_zombie(pid: int) -> bool:
    """A process that has exited and waits to be reaped (a killed trainer's worker, where
    nothing reaps orphans); False where ``/proc`` cannot tell."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    fields = stat[stat.rfind(b")") + 1 :].split()
    return bool(fields) and fields[0] in (b"Z", b"X")


def parse_temp_name(name: str) -> TempName | None:
    """The parts of a base name made by :func:`temp_name`; None for any other name."""
    match = _TEMP_NAME.fullmatch(name)
    if match is None:
        return None
    return TempName(match["final"], int(match["pid"]), match["host"])


def stale_temp_files(directory: str) -> list[str]:
    """Temporary files of :func:`temp_name` directly in ``directory`` whose writer is gone:
    left by a process killed while it wrote, never to be renamed. Files of a live writer,
    of another host, or of any other pattern are never listed."""
    try:
        names = sorted(os.listdir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []
    stale = []
    for name in names:
        parsed = parse_temp_name(name)
        if parsed is None:
            continue
        if parsed.writer_gone() and os.path.isfile(os.path.join(directory, name)):
            stale.append(os.path.join(directory, name))
    return stale


def remove_stale_temp_files(directory: str) -> list[str]:
    """Delete :func:`stale_temp_files` of ``directory``; return the paths deleted."""
    removed = []
    for path in stale_temp_files(directory):
        try:
            os.unlink(path)
        except FileNotFoundError:  # another cleaner came first
            continue
        removed.append(path)
    return removed


@contextmanager
def atomic_file(
    path: str,
    *,
    sync: bool = True,
    sync_dir: bool = True,
    opener: Callable[[str, str], IO[bytes]] = open,
) -> Iterator[IO[bytes]]:
    """A binary file whose content replaces ``path`` atomically when the block exits cleanly.

    On an exception the temporary file is removed and ``path`` is left as it was.
    ``sync=False`` skips every fsync; ``sync_dir=False`` skips only the directory's (for a
    caller that makes a batch of renames durable with one directory fsync of its own).
    ``opener(temporary_path, "wb")`` opens the file (NVRx's ``open_file`` hook).
    """
    tmp = temp_name(path)
    try:
        with opener(tmp, "wb") as f:
            yield f
            f.flush()
            if sync:
                os.fsync(f.fileno())
    except BaseException:
        _unlink_quietly(tmp)
        raise
    directory = os.path.dirname(os.path.abspath(path))
    RenameCommit(directory, [(tmp, path)], sync=sync_dir and sync).commit(
        on_error=lambda: _unlink_quietly(tmp)
    )


def write_atomically(path: str, write: Callable[[IO[bytes]], None], sync: bool = True) -> None:
    """Write ``path`` through ``write(f)``: readers see the old file or the whole new one."""
    with atomic_file(path, sync=sync) as f:
        write(f)


class RenameCommit:
    """Publish files written under temporary names: rename each, then fsync the directory.

    The files must already be complete and fsynced (by whoever wrote them). All renames
    are in ``directory``, so one directory fsync makes the whole batch durable.
    """

    def __init__(
        self, directory: str, renames: Sequence[tuple[str, str]], *, sync: bool = True
    ) -> None:
        self.directory = directory
        self.renames = list(renames)
        self.sync = sync

    def commit(self, on_error: Callable[[], None] | None = None) -> None:
        """Commit; on a failed rename run ``on_error`` and raise."""
        for temporary, final in self.renames:
            try:
                os.replace(temporary, final)
            except OSError as exc:
                if on_error is not None:
                    on_error()
                raise StorageError(f"committing {temporary} as {final} failed: {exc}") from exc
        if self.sync:
            fsync_dir(self.directory)


class RecordCommit:
    """A checkpoint directory on any backend, committed by a record written last.

    Protocol: ``uncommit()`` before rewriting a committed directory; write every data file;
    once all succeeded, ``commit(write)`` writes the record; ``discard()`` deletes a
    checkpoint, record first. ``sync=False`` trades crash durability for speed, as the
    writers' ``sync_files`` does.
    """

    def __init__(
        self,
        backend: StorageBackend,
        directory: str,
        *,
        record: str = COMMIT_RECORD,
        sync: bool = True,
    ) -> None:
        self.backend = backend
        self.directory = directory
        self.record = record
        self.sync = sync

    @property
    def record_path(self) -> str:
        return self.backend.join(self.directory, self.record)

    def is_committed(self) -> bool:
        return self.backend.exists(self.record_path)

    def commit(self, write: Callable[[BinaryIO], None]) -> None:
        """Write the record through ``write(f)``; it appears whole or not at all."""
        with self.backend.open_write(self.record_path, sync=self.sync) as f:
            write(f)

    def uncommit(self) -> None:
        """Remove the record, durably when ``sync``: the directory is no checkpoint now."""
        self.backend.delete(self.record_path, sync=self.sync)

    def discard(self) -> None:
        """Delete the checkpoint: the record first (on an object store, deleting a prefix is
        many requests; without its record the checkpoint is invisible at once, and an
        interrupted deletion leaves only unreferenced data), then everything else."""
        self.uncommit()
        self.backend.delete(self.directory, recursive=True)


def is_committed_listing(listing: Listing) -> bool:
    """Whether a directory listing holds the DCP commit record."""
    return COMMIT_RECORD in listing.files


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
