"""What ``FileSystemWriterAsync``'s constructor checks, so a bad writer fails on the spot.

Every check runs when the writer is made, in the trainer, outside any collective: a bad
option or an unwritable directory raises there, on the rank that has it, with the
parameter named, instead of failing later inside planning (where the other ranks would wait
in a collective) or in the background write. The directory check creates and removes a file
(the one reliable test: root ignores permission bits) in the checkpoint directory or the
ancestor it will be created in, once per directory and process; it applies to local paths
only (object stores have no directories to probe; their first upload reports a bad profile
or bucket).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ..errors import ConfigurationError
from ..storage.base import is_msc_url
from ..storage.posix import probe_writable


def check_flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(f"FileSystemWriterAsync({name}=...) must be a bool, got {value!r}")
    return value


def check_open_file(open_file: Any, use_msc: bool, checkpoint_dir: str) -> Callable[..., Any]:
    if not callable(open_file):
        raise ConfigurationError(
            f"FileSystemWriterAsync(open_file=...) must be callable like open(path, mode), "
            f"got {open_file!r}"
        )
    if open_file is not open and (use_msc or is_msc_url(checkpoint_dir)):
        raise ConfigurationError(
            "FileSystemWriterAsync(open_file=...) applies to local paths only; with msc the "
            "multi-storage-client opens the objects (drop open_file or use_msc)"
        )
    return open_file


def checkpoint_dir_of(path: Any) -> str:
    if isinstance(path, (str, os.PathLike)):
        return os.fspath(path) if not isinstance(path, str) else path
    raise ConfigurationError(f"checkpoint path must be a str or os.PathLike, got {path!r}")


def check_writer_options(writer: Any, checkpoint_dir: str, *, local: bool) -> None:
    """The options ``FileSystemWriter`` stored on ``writer``, and a ``local`` path itself."""
    if not isinstance(writer.thread_count, int) or writer.thread_count < 1:
        raise ConfigurationError(f"thread_count must be an int >= 1, got {writer.thread_count!r}")
    hint = writer.separation_hint
    if hint is not None and (not isinstance(hint, str) or not hint):
        raise ConfigurationError(f"separation_hint must be a non-empty str or None, got {hint!r}")
    fmt = getattr(writer, "serialization_format", None)
    if fmt is not None and getattr(fmt, "value", fmt) != "torch_save":
        raise ConfigurationError(
            f"FileSystemWriterAsync writes the torch_save format only, got {fmt!r}"
        )
    if local:
        if os.path.exists(checkpoint_dir) and not os.path.isdir(checkpoint_dir):
            raise ConfigurationError(
                f"checkpoint path {checkpoint_dir!r} exists and is not a directory"
            )
        _probe_writable(_nearest_existing_dir(checkpoint_dir))


def _nearest_existing_dir(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


# Directories a probe found writable, most recent last. A job makes a writer per save, in a
# new checkpoint directory under the same parent: probing that parent once per process is
# enough, and saves every later save a file create and unlink (metadata operations that
# cost milliseconds on a parallel file system, from every rank at once). Write access lost
# later fails that save's background write, which is reported on every rank.
_PROBED: OrderedDict[str, None] = OrderedDict()
_PROBED_MAX = 64
_probed_lock = threading.Lock()


def _probe_writable(directory: str) -> None:
    """``probe_writable`` on ``directory`` (the checkpoint directory or the ancestor it
    will be created in), when the writer is made, so a bad path fails there, before any
    collective; once per directory and process (see ``_PROBED``)."""
    with _probed_lock:
        if directory in _PROBED:
            _PROBED.move_to_end(directory)
            return
    probe_writable(directory)
    with _probed_lock:
        _PROBED[directory] = None
        while len(_PROBED) > _PROBED_MAX:
            _PROBED.popitem(last=False)
