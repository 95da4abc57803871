"""What the command-line tool trusts: nothing in a checkpoint, unless the user says so.

The tool is pointed at files of any origin (a download, a shared bucket), and unpickling a
file runs whatever globals it names. So by default every pickle it reads is loaded safely:

* our and DCP's own pickles (a DCP ``.metadata``, a memory tier's commit record) through
  :mod:`resilient_ckpt._restricted_pickle`, which allows exactly the classes those files
  hold;
* user state (a ``torch.save`` file, a DCP checkpoint's non-tensor items) with
  ``torch.load(weights_only=True)``: tensors, containers and plain values, and the classes
  the user allowed with ``torch.serialization.add_safe_globals``;
* a local checkpoint's state in the managers' safe mode (``weights_only=True``: plain
  values, the format's own classes, the globals marked safe; see
  :mod:`.local_checkpoints`). Verifying one needs no unpickling (its checksums are checked
  on the bytes).

``--trust`` (``trusted=True`` in Python) unpickles in full, as ``torch.load(weights_only=
False)`` does. Every failure becomes a named error carrying the file and what is wrong with
it: :class:`~resilient_ckpt.errors.UnsafeCheckpointError` for a refused global (named, with
how to allow it), :class:`~resilient_ckpt.errors.CorruptCheckpointError` for a file that is
empty, cut short, garbage or of the wrong kind. The command prints those as one line.
"""

from __future__ import annotations

import io
import pickle
import re
from typing import IO, Any

import torch

from .. import _restricted_pickle
from ..errors import CorruptCheckpointError, UnsafeCheckpointError

TRUST_HELP = (
    "unpickle the checkpoint's files in full (torch.load(weights_only=False)): a file can "
    "then run any code on this machine, with your rights. Only for files whose origin you "
    "trust; without it, files are loaded safely (tensors, containers, plain values)"
)

_HOW_TO_ALLOW = (
    "If you trust where the file came from, pass --trust (trusted=True in Python); for a "
    "class you know, allow it with torch.serialization.add_safe_globals([{cls}])"
)


def load_pickle(f: IO[bytes], *, path: str, trusted: bool, expect: Any = None) -> Any:
    """One of our or DCP's own pickles (restricted unless ``trusted``)."""
    return _restricted_pickle.load(f, path=path, expect=expect, trusted=trusted)


def torch_load(f: IO[bytes], *, path: str, trusted: bool) -> Any:
    """``torch.load`` of ``f`` onto the CPU, safely unless ``trusted``; named errors only."""
    start = _tell(f)
    try:
        return torch.load(f, map_location="cpu", weights_only=not trusted)
    except OSError:
        raise
    except Exception as exc:
        if not trusted and isinstance(exc, pickle.UnpicklingError):
            refused = _refused_global(exc, f, start)
            if refused:
                raise UnsafeCheckpointError(
                    f"{path}: refused to load the global {refused}: torch's safe loader "
                    "(weights_only=True) does not allow it, and loading it could run code "
                    "from the file; nothing was run. "
                    + _HOW_TO_ALLOW.format(cls=refused.rsplit(".", 1)[-1]),
                    path=path,
                    name=refused,
                ) from exc
        raise CorruptCheckpointError(f"{path}: {_what_is_wrong(exc, f, start)}", path=path) from exc


# torch names the global it refused in its message ("... GLOBAL posix.system ..."); the
# wording changed between releases, the "GLOBAL <module>.<name>" part did not.
_GLOBAL = re.compile(r"GLOBAL ([A-Za-z_][\w.]*)")


def _refused_global(exc: BaseException, f: IO[bytes], start: int) -> str | None:
    unsafe = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    if unsafe is not None and start >= 0:
        try:
            f.seek(start)
            names = unsafe(f)  # reads the archive's pickle without running it
        except Exception:  # not an archive (legacy format) or damaged: use the message
            names = []
        if names:
            return str(names[0])
    found = _GLOBAL.search(str(exc))
    return found.group(1) if found else None


def _what_is_wrong(exc: BaseException, f: IO[bytes], start: int) -> str:
    size = _size(f)
    if size is not None and size - max(start, 0) == 0:
        return "is empty"
    if isinstance(exc, EOFError):
        return "is truncated (its pickle ends early)"
    text = str(exc)
    if "WeightsUnpickler error:" in text:  # torch's safe loader met bytes it cannot read
        text = text.split("WeightsUnpickler error:", 1)[1]
    line = next((s.strip() for s in text.splitlines() if s.strip()), "")
    if len(line) > 200:
        line = line[:200] + "..."
    return f"not a readable torch.save file ({type(exc).__name__}: {line})"


def _tell(f: IO[bytes]) -> int:
    try:
        return f.tell()
    except (OSError, ValueError, AttributeError):
        return -1


def _size(f: IO[bytes]) -> int | None:
    try:
        return int(f.seek(0, io.SEEK_END))
    except (OSError, ValueError, AttributeError):
        return None
