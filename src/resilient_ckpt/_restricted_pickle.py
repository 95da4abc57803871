"""The one unpickler for files in our formats and DCP's: it never runs a file's code.

Unpickling imports and calls whatever globals the pickle names (``os.system`` included). The
files read here (DCP's ``.metadata``, the tiered manager's commit records and file tables)
hold plain data: DCP's metadata dataclasses and save plans, ``torch.Size``, dtypes, layouts,
paths, builtin containers. :func:`load` allows exactly those, by exact (module, name) resolved
from already imported objects, and refuses anything else before importing it
(:class:`~resilient_ckpt.errors.UnsafeCheckpointError` naming file and global); a damaged file
is a :class:`~resilient_ckpt.errors.CorruptCheckpointError` saying what is wrong.

Not torch's ``weights_only`` unpickler: it is built for ``torch.save`` archives (not public
for plain pickles) and lacks DCP's classes. Its extension point is honoured though: a global
the user marked safe (``torch.serialization.add_safe_globals`` or ``safe_globals``, read at
each load) is allowed, as ``torch.load(weights_only=True)`` would.

User state, in the managers' safe mode (``weights_only=True``): :func:`load_state` reads our
formats' pickles with plain values, the format's classes and the user's safe globals;
:func:`torch_load`, the package's one safe ``torch.load`` (the CLI's ``--trust`` too), reads
``torch.save`` archives and maps torch's refusals and failures to the same named errors.
"""

from __future__ import annotations

import builtins
import collections
import functools
import io
import os
import pathlib
import pickle
import re
from collections.abc import Iterable, Mapping
from typing import IO, Any, cast

import torch

from ._torch_compat import (
    dcp_metadata_globals,
    extra_safe_globals,
    unsafe_globals_in,
    user_safe_globals,
)
from .errors import CheckpointingException, CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["load", "load_state", "loads", "torch_load"]

Global = tuple[str, str]

_BUILTINS = ("bool", "bytes", "dict", "float", "frozenset", "int", "list", "set", "str", "tuple")

_HOW_TO_ALLOW = (
    "If you trust the file and the global is harmless, allow it with "
    "torch.serialization.add_safe_globals([{name}]) or within "
    "torch.serialization.safe_globals([...])"
)


@functools.cache
def _plain() -> dict[Global, Any]:
    """Builtin containers and values, ``OrderedDict``, ``torch.Size``, dtypes, layouts and
    memory formats: what every file read here may hold."""
    allowed: dict[Global, Any] = {("builtins", n): getattr(builtins, n) for n in _BUILTINS}
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    allowed[("torch", "Size")] = torch.Size
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", name)] = value
    return allowed


class StoredPath(os.PathLike):
    """A storage library's path object in a DCP ``.metadata`` (multi-storage-client records
    ``checkpoint_id`` as a ``MultiStoragePath``, whose unpickling would set up a storage
    client), read back as the plain path string it names."""

    def __init__(self, path: str = "") -> None:
        self.path = path

    def __setstate__(self, state: Any) -> None:
        path = state.get("_path") if isinstance(state, dict) else state
        if not isinstance(path, str):
            raise TypeError(f"a stored path must be a string, got {type(path).__name__}")
        self.path = path

    def __fspath__(self) -> str:
        return self.path

    def __str__(self) -> str:
        return self.path

    def __repr__(self) -> str:
        return f"StoredPath({self.path!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StoredPath) and other.path == self.path

    def __hash__(self) -> int:
        return hash(self.path)


@functools.cache
def _format_globals() -> dict[Global, Any]:
    """What DCP's ``.metadata`` and our commit records hold (see the module docstring)."""
    from torch.distributed.checkpoint import metadata, planner

    allowed = dict(_plain())
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
    # The local plans a decentralized save keeps in its metadata (``all_local_plans``: our
    # writer's and Megatron's, to check the next save may reuse it): a SavePlan's types.
    for name in ("BytesIOWriteData", "SavePlan", "TensorWriteData", "WriteItem", "WriteItemType"):
        if hasattr(planner, name):
            allowed[(planner.__name__, name)] = getattr(planner, name)
    allowed.update(dcp_metadata_globals())
    allowed[("multistorageclient.pathlib", "MultiStoragePath")] = StoredPath
    return allowed


@functools.cache
def _state_globals() -> dict[Global, Any]:
    """Plain values a user's state holds: torch's default ``weights_only`` list, no tensors."""
    allowed = dict(_plain())
    allowed.update(
        {
            ("builtins", "complex"): complex,
            ("builtins", "bytearray"): bytearray,
            ("collections", "Counter"): collections.Counter,
            ("torch", "device"): torch.device,
        }
    )
    return allowed


class _Unpickler(pickle.Unpickler):
    """Resolves a global from ``allowed`` (by module and name), else from the globals the
    user marked safe (by ``"module.qualname"``, as torch matches them, read at each load)."""

    def __init__(
        self, file: IO[bytes], path: str, allowed: Mapping[Global, Any], refusal: str
    ) -> None:
        super().__init__(file)
        self._path = path
        self._allowed = allowed
        self._refusal = refusal
        self._user: dict[str, Any] | None = None

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get((module, name))
        if found is not None:
            return found
        if self._user is None:
            self._user = user_safe_globals()
        full = f"{module}.{name}"
        try:
            return self._user[full]
        except KeyError:
            raise UnsafeCheckpointError(
                f"{self._path}: refused to load the global {full}: {self._refusal}; nothing "
                f"was imported or run. {_HOW_TO_ALLOW.format(name=full)}",
                path=self._path,
                name=full,
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(
            f"{self._path}: refused a persistent id ({pid!r}): this kind of file holds no "
            "external references (is it a torch.save archive?)",
            path=self._path,
            name="persistent_load",
        )


def _unpickle(
    file: IO[bytes],
    path: str,
    allowed: Mapping[Global, Any] | None,
    refusal: str,
    expect: type | tuple[type, ...] | None,
) -> Any:
    # ``allowed`` None: every global (the caller's user trusts the file's origin).
    # Read whole first: these files are small, and only then is "empty" or "truncated" a
    # fact about the file (the unpickler reads ahead of what it has consumed).
    data = file.read()
    if not data:
        raise CorruptCheckpointError(f"{path}: is empty", path=path)
    try:
        stream = io.BytesIO(data)
        unpickler = (
            pickle.Unpickler(stream)
            if allowed is None
            else _Unpickler(stream, path, allowed, refusal)
        )
        value = unpickler.load()
    except (UnsafeCheckpointError, CorruptCheckpointError):
        raise
    except (EOFError, pickle.UnpicklingError) as exc:
        if isinstance(exc, EOFError) or "truncated" in str(exc):
            what = f"is truncated (its {len(data)} bytes end inside the pickle)"
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


_FORMAT_REFUSAL = (
    "this kind of file holds only DCP metadata, torch sizes, dtypes and builtin containers, "
    "so it is damaged, not a checkpoint file of this kind, or built to run code"
)


def load(
    file: IO[bytes] | io.IOBase,
    *,
    path: str,
    expect: type | tuple[type, ...] | None = None,
    trusted: bool = False,
) -> Any:
    """Unpickle ``file`` (from its position; ``path`` names it in errors), allowing only the
    globals of our and DCP's formats and the user's safe globals. With ``expect``, a value of
    another type is a named error. ``trusted=True`` allows every global (the file can run
    code), for a caller whose user trusts its origin; damaged files get the same errors."""
    allowed = None if trusted else _format_globals()
    return _unpickle(cast(IO[bytes], file), path, allowed, _FORMAT_REFUSAL, expect)


def loads(
    data: bytes,
    *,
    path: str,
    expect: type | tuple[type, ...] | None = None,
    trusted: bool = False,
) -> Any:
    """:func:`load` of bytes already read from ``path``."""
    return load(io.BytesIO(data), path=path, expect=expect, trusted=trusted)


def load_state(
    file: IO[bytes],
    *,
    path: str,
    allowed: Iterable[Any] = (),
    refusal: str = "it is not a plain value, a class of this checkpoint format, nor a "
    "global marked safe with torch.serialization.add_safe_globals",
    expect: type | tuple[type, ...] | None = None,
) -> Any:
    """Unpickle a user's state in one of our formats, in safe mode: plain values, the format's
    classes in ``allowed`` and the user's safe globals. A nested ``pickle.loads`` (how our
    formats splice parts pickled once) follows the same rules. ``refusal`` says, in a refused
    global's error, why."""
    table = dict(_state_globals())
    table.update({(c.__module__, c.__qualname__): c for c in allowed})

    def nested(payload: bytes) -> Any:
        if not isinstance(payload, (bytes, bytearray)):
            raise CorruptCheckpointError(f"{path}: a nested pickle that is not bytes", path=path)
        return _unpickle(io.BytesIO(payload), path, table, refusal, None)

    table[("_pickle", "loads")] = table[("pickle", "loads")] = nested
    return _unpickle(file, path, table, refusal, expect)


def torch_load(
    data: bytes | bytearray | memoryview | IO[bytes],
    *,
    path: str,
    trusted: bool = False,
    allowed: Iterable[Any] = (),
    trust_advice: str = "load it with weights_only=False",
    **kwargs: Any,
) -> Any:
    """``torch.load`` of a ``torch.save`` file: ``data`` is its bytes, or a binary file read
    from its position; ``path`` names it in errors; ``kwargs`` go to ``torch.load``.

    Safe unless ``trusted``: ``weights_only=True`` with ``allowed`` (objects, or
    ``(object, "module.name")`` pairs) allowed for this load besides the user's safe globals. A
    refused global is an :class:`~resilient_ckpt.errors.UnsafeCheckpointError` naming ``path``
    and the global, how to allow it and (``trust_advice``) how to load a trusted file.
    ``trusted``: ``weights_only=False``, the file may run any code. Either way a damaged file
    is a :class:`~resilient_ckpt.errors.CorruptCheckpointError`; an ``OSError`` (the storage
    failed, not the file) passes unchanged.
    """
    stream = io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
    start = _tell(stream)
    try:
        with extra_safe_globals([] if trusted else list(allowed)):
            try:
                return torch.load(stream, weights_only=not trusted, **kwargs)
            except pickle.UnpicklingError as exc:
                # Inside the context: the globals allowed for this load are not refused.
                refused = [] if trusted else _refused_globals(exc, stream, start)
                if refused:
                    raise _refusal(path, refused, trust_advice) from None
                raise
    except (OSError, CheckpointingException):
        raise
    except Exception as exc:  # a damaged file fails in many ways (see _what_is_wrong)
        what = _what_is_wrong(exc, stream, start)
        raise CorruptCheckpointError(f"{path}: {what}", path=path) from exc


def _refusal(path: str, refused: list[str], trust_advice: str) -> UnsafeCheckpointError:
    names, several = ", ".join(refused), len(refused) > 1
    them = "them" if several else "it"
    return UnsafeCheckpointError(
        f"{path}: refused to load the global{'s' if several else ''} {names}: torch's safe "
        f"loader (weights_only=True) does not allow {them}, as loading {them} could run code "
        "from the file; nothing was imported or run. "
        + _HOW_TO_ALLOW.format(name=names)
        + f"; or, if you trust where the file came from, {trust_advice}",
        path=path,
        name=refused[0],
    )


# How torch's weights_only unpickler names a global it refuses in its message (torch 2.4
# to 2.13: "GLOBAL m.n was not an allowed global", "unsupported GLOBAL m.n whose module m is
# blocked"): the wording changed between releases, this part did not.
_TORCH_REFUSED = re.compile(r"GLOBAL ([A-Za-z_][\w.]*)")


def _refused_globals(exc: BaseException, stream: IO[bytes], start: int) -> list[str]:
    """The globals that made torch refuse the file: read from the archive where this torch
    can tell (public API), else from torch's message (torch 2.4, legacy-format files);
    none when the file is merely damaged."""
    if start >= 0:
        try:
            stream.seek(start)
        except (OSError, ValueError):
            start = -1
    found = unsafe_globals_in(stream) if start >= 0 else None
    if found:
        return found
    named = _TORCH_REFUSED.search(str(exc))
    return [named.group(1)] if named else []


def _what_is_wrong(exc: BaseException, stream: IO[bytes], start: int) -> str:
    """What a ``torch.load`` failure says about the file: empty, cut short, or unreadable in
    torch's own words (first line; each format fails in its own way)."""
    size = _size(stream)
    if size is not None and start >= 0 and size == start:
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


def _tell(stream: IO[bytes]) -> int:
    try:
        return stream.tell()
    except (OSError, ValueError, AttributeError):
        return -1


def _size(stream: IO[bytes]) -> int | None:
    try:
        return int(stream.seek(0, io.SEEK_END))
    except (OSError, ValueError, AttributeError):
        return None
