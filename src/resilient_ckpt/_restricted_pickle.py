"""The one unpickler for files in our formats and DCP's: it never runs a file's code.

A pickle names the globals it needs and the unpickler imports and calls them, so loading
a pickle from elsewhere runs whatever it names (``os.system`` included). The files read
here (a DCP checkpoint's ``.metadata``, the tiered manager's commit records and file
tables) hold plain data: DCP's metadata dataclasses, ``torch.Size``, dtypes and layouts,
paths, and builtin containers. :func:`load` allows exactly those and refuses anything else
with :class:`~resilient_ckpt.errors.UnsafeCheckpointError`, naming the file and the global,
before anything is imported. Damaged files (empty, truncated, not a pickle, or a pickle
of the wrong kind) raise :class:`~resilient_ckpt.errors.CorruptCheckpointError` naming the
file and what is wrong with it.

Decision: an allow-list by exact (module, name), resolved from objects this process has
already imported, rather than torch's ``weights_only`` unpickler: that one is built for
``torch.save`` archives (it is not public for plain pickles), and its allow-list lacks
DCP's metadata classes. User state from files of unknown origin is a different question,
answered by ``torch.load(weights_only=True)`` (see :mod:`resilient_ckpt.cli`).
"""

from __future__ import annotations

import builtins
import collections
import functools
import io
import pathlib
import pickle
from typing import IO, Any

import torch

from .errors import CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["load", "loads"]

_BUILTINS = ("bool", "bytes", "dict", "float", "frozenset", "int", "list", "set", "str", "tuple")


@functools.cache
def _allowed() -> dict[tuple[str, str], Any]:
    from torch.distributed.checkpoint import metadata

    from ._torch_compat import dcp_metadata_globals

    allowed: dict[tuple[str, str], Any] = {("builtins", n): getattr(builtins, n) for n in _BUILTINS}
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    allowed[("torch", "Size")] = torch.Size
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", name)] = value
    for cls in (pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.PosixPath):
        allowed[("pathlib", cls.__name__)] = cls
    for name in (
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
    ):
        if hasattr(metadata, name):
            allowed[(metadata.__name__, name)] = getattr(metadata, name)
    allowed.update(dcp_metadata_globals())
    return allowed


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: IO[bytes], path: str) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _allowed()[(module, name)]
        except KeyError:
            raise UnsafeCheckpointError(
                f"{self._path}: refused to load the global {module}.{name}: this kind of file "
                "holds only DCP metadata, torch sizes, dtypes and builtin containers, so it is "
                "damaged, not a checkpoint file of this kind, or built to run code; nothing "
                "was imported or run. Load it only if you trust where it came from (the CLI's "
                "--trust, trusted=True in the API)",
                path=self._path,
                name=f"{module}.{name}",
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(
            f"{self._path}: refused a persistent id ({pid!r}): this kind of file holds no "
            "external references (is it a torch.save archive?)",
            path=self._path,
            name="persistent_load",
        )


def load(
    file: IO[bytes],
    *,
    path: str,
    expect: type | tuple[type, ...] | None = None,
    trusted: bool = False,
) -> Any:
    """Unpickle ``file`` (read from its current position; ``path`` names it in errors),
    allowing only the globals of our and DCP's formats. With ``expect``, the object must be
    an instance of it (a pickle of another kind is a named error). ``trusted=True`` allows
    every global, as ``pickle.load`` does (the file can run code): for a caller whose user
    said the file's origin is trusted; damaged files get the same named errors."""
    unpickler = pickle.Unpickler(file) if trusted else _Unpickler(file, path)
    try:
        value = unpickler.load()
    except (UnsafeCheckpointError, OSError):
        raise
    except (EOFError, pickle.UnpicklingError) as exc:
        at = _position(file)
        if at == 0 and _is_empty(file):
            raise CorruptCheckpointError(f"{path}: is empty", path=path) from None
        if isinstance(exc, EOFError) or "truncated" in str(exc):
            what = f"is truncated (its pickle ends early, at byte {at})"
            raise CorruptCheckpointError(f"{path}: {what}", path=path) from None
        raise CorruptCheckpointError(f"{path}: not a pickle ({exc})", path=path) from None
    except Exception as exc:
        # A damaged pickle fails in many ways (UnpicklingError, ValueError, TypeError from a
        # constructor given the wrong fields, ...): all of them mean the file is unreadable.
        raise CorruptCheckpointError(
            f"{path}: not a readable pickle ({type(exc).__name__}: {exc})", path=path
        ) from exc
    if expect is not None and not isinstance(value, expect):
        names = expect if isinstance(expect, tuple) else (expect,)
        raise CorruptCheckpointError(
            f"{path}: holds a {type(value).__name__}, not a "
            f"{' or '.join(t.__name__ for t in names)} (is it the right file?)",
            path=path,
        )
    return value


def loads(
    data: bytes,
    *,
    path: str,
    expect: type | tuple[type, ...] | None = None,
    trusted: bool = False,
) -> Any:
    """:func:`load` of bytes already read from ``path``."""
    return load(io.BytesIO(data), path=path, expect=expect, trusted=trusted)


def _is_empty(file: IO[bytes]) -> bool:
    # Nothing consumed does not mean nothing there: reading from a buffered file, the
    # unpickler peeks at a bad first byte without consuming it.
    try:
        return file.seek(0, io.SEEK_END) == 0
    except (OSError, ValueError, AttributeError):
        return True


def _position(file: IO[bytes]) -> int:
    try:
        return file.tell()
    except (OSError, ValueError):
        return -1
