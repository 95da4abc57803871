"""Reading local checkpoints that NVRx wrote, so the first resume after switching keeps them.

NVRx leaves, in the same directories and under the same names as ours,
``iter_<iteration:07d>_<owner>_local.pt``: a ``torch.save`` of the ``TensorAwareStateDict``
(tensors on the host), one per copy held; no manifest, no checksum, no fsync. It writes
``...dirty.pt``, renames it as soon as ``torch.save`` returns, and its finalize deletes every
file of an iteration that did not reach the final name on *every* rank.

**Such a file is judged complete** when all of these hold (else it is treated as missing,
like a corrupt copy of ours):

1. It has the final name (a ``.dirty.pt`` was interrupted and is removed).
2. No manifest of ours is next to it and it starts with the zip signature (ours start with
   ``RCLOCAL``, so our shard that lost its manifest is never taken for NVRx's).
3. It is a well-formed ``torch.save`` archive: the zip central directory, written last, is
   present and lists ``data.pkl``. A file cut short by a crash (NVRx never fsyncs) has none.
4. Every record's CRC-32 stored by ``torch.save`` matches its bytes: the checksum our
   manifest would hold, record by record. A stored CRC of 0 (torch's CRC switched off) is
   accepted on the structure alone.
5. As for ours, an iteration is complete only when every shard has such a copy somewhere:
   NVRx's own rule; NVRx deletes the files of a save that failed on any rank, so leftovers
   never complete an iteration.

NVRx records neither world size nor replication setup, so those checks cannot be made:
resume with the NVRx job's ranks and replication, as NVRx itself requires. Classes pickled
under ``nvidia_resiliency_ext.checkpointing`` load from the real package when installed,
else from ours; NVRx's ``BasicTensorAwareStateDict`` becomes ours (:mod:`._nvrx_basic`).
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import types
import zipfile
from typing import Any

import torch

from .. import _restricted_pickle
from ..errors import CorruptCheckpointError
from .base_state_dict import TensorAwareStateDict

__all__ = ["is_nvrx_bytes", "is_nvrx_file", "load_state", "read_verified_nvrx", "verify"]

ZIP_MAGIC = b"PK\x03\x04"
_NVRX = "nvidia_resiliency_ext.checkpointing"
_OURS = "resilient_ckpt"
_BASIC = (f"{_NVRX}.local.basic_state_dict", "BasicTensorAwareStateDict")
_CHUNK = 16 << 20


def bytes_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a CPU uint8 tensor (no copy)."""
    array: Any = tensor.numpy()
    return memoryview(array).cast("B")


def is_nvrx_bytes(raw: memoryview | bytes) -> bool:
    return bytes(raw[: len(ZIP_MAGIC)]) == ZIP_MAGIC


def is_nvrx_file(path: str) -> bool:
    """Whether ``path`` starts like a ``torch.save`` archive (cheap: reads four bytes)."""
    with open(path, "rb") as f:
        return is_nvrx_bytes(f.read(len(ZIP_MAGIC)))


def verify(raw: memoryview | bytes, path: str) -> None:
    """Rules 3 and 4 of the module docstring; ``CorruptCheckpointError`` if one fails."""
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            records = archive.infolist()
            if not any(r.filename.endswith("data.pkl") for r in records):
                raise CorruptCheckpointError(
                    f"{path}: a zip file but not a torch.save archive (no data.pkl)", path=path
                )
            for record in records:
                if record.CRC == 0 and record.file_size:
                    continue
                with archive.open(record) as f:  # zipfile checks the CRC at the end
                    while f.read(_CHUNK):
                        pass
    except CorruptCheckpointError:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, ValueError) as exc:
        raise CorruptCheckpointError(
            f"{path}: incomplete or damaged torch.save archive: {exc}", path=path
        ) from exc


def read_verified_nvrx(path: str) -> torch.Tensor:
    """The file's bytes as one uint8 tensor, verified as the module docstring says."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        out = torch.empty(size, dtype=torch.uint8)
        view = bytes_view(out)
        got = 0
        while got < size:
            n = f.readinto(view[got:]) or 0
            if n == 0:
                break
            got += n
    if got != size:
        raise CorruptCheckpointError(f"{path}: shrank while being read", path=path)
    verify(view, path)
    return out


def _real_nvrx(module: str, name: str) -> Any:
    """The class from an installed NVRx, or None (absent, or an alias of this package)."""
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    if str(getattr(found, "__module__", "")).startswith(_OURS):
        return None
    return found


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == _NVRX or module.startswith(_NVRX + "."):
            real = _real_nvrx(module, name)
            if real is not None:
                return real
            if (module, name) == _BASIC:
                from ._nvrx_basic import MigratedBasicStateDict

                return MigratedBasicStateDict
            module = _OURS + module[len(_NVRX) :]
        return super().find_class(module, name)


def _pickle_module() -> types.ModuleType:
    """What ``torch.load(pickle_module=...)`` needs: ``Unpickler`` and ``load``."""
    module = types.ModuleType("resilient_ckpt_nvrx_pickle")
    module.Unpickler = _Unpickler  # type: ignore[attr-defined]
    module.load = lambda f, **kw: _Unpickler(f, **kw).load()  # type: ignore[attr-defined]
    module.__dict__.update({"loads": pickle.loads, "UnpicklingError": pickle.UnpicklingError})
    return module


def load_state(
    raw: memoryview | bytes, *, weights_only: bool = False, source: str = "NVRx local checkpoint"
) -> TensorAwareStateDict:
    """The object NVRx saved, as ``torch.load`` returns it (tensors where they were saved).

    Trusted by default, as NVRx's own load. ``weights_only`` (the managers' safe mode) uses
    torch's ``weights_only`` unpickler with NVRx's ``BasicTensorAwareStateDict`` allowed as
    ours (torch 2.5+: 2.4 cannot allow a class under another name, and refuses it); other
    classes must be marked safe by the user, or the load is refused, naming ``source``.
    """
    if weights_only:
        from ._nvrx_basic import MigratedBasicStateDict

        allowed = [(MigratedBasicStateDict, ".".join(_BASIC))]
        return _restricted_pickle.torch_load(  # type: ignore[no-any-return]
            bytes(raw), path=source, allowed=allowed
        )
    state = torch.load(io.BytesIO(raw), weights_only=False, pickle_module=_pickle_module())
    return state  # type: ignore[no-any-return]
