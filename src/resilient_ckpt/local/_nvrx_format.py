"""Reading local checkpoints that NVRx wrote, so the first resume after switching keeps them.

What NVRx (``nvidia_resiliency_ext.checkpointing.local``) leaves on disk, in the same
directories and under the same names as ours (``<root>/<session_id>/<rank>/``):

* ``iter_<iteration:07d>_<owner>_local.pt``: ``torch.save`` of the ``TensorAwareStateDict``
  (tensors on the host after ``copy_tensors_to_cpu``), one file per copy this rank holds:
  its own shard and, with replication, those of its clique peers (``<owner>`` is the rank
  whose shard it is). No manifest, no checksum of its own, no fsync.
* While being written the file is ``iter_..._local.dirty.pt``; NVRx renames it to the final
  name as soon as ``torch.save`` has returned, and its finalize step deletes every file of
  an iteration that did not reach the final name on *every* rank.

**How such a file is judged complete without our manifest** (all must hold, else the copy
is treated as missing, exactly like a corrupt copy of ours):

1. It has the final name: a ``.dirty.pt`` file was interrupted (removed, like ours).
2. No manifest of ours is next to it and it starts with the zip signature: our shards
   start with ``RCLOCAL``, so a shard of ours that lost its manifest is never taken for
   NVRx's.
3. It is a well-formed ``torch.save`` archive: the zip central directory, which is written
   last, is present and lists a ``data.pkl`` record. A file cut short (a crash before
   the page cache reached the disk; NVRx never fsyncs) has no central directory.
4. Every record's CRC-32, which ``torch.save`` stores in the archive, matches its bytes:
   this is the checksum our manifest would have held, record by record, and it catches
   torn or flipped data. (A record whose stored CRC is 0 was written with torch's CRC
   computation switched off and is accepted on the structure alone.)
5. As for our copies, an iteration is complete only when every rank's shard has such a
   copy: its owner's own file, or with replication a peer's replica of it. This is
   NVRx's own rule, and since NVRx deletes the files of a save that failed on any rank,
   leftovers of a failed save never complete an iteration.

NVRx records neither the world size nor the replication setup of the writing job, so
those two checks of our manifests cannot be made: resume with the same number of ranks
(and replication) as the NVRx job, as NVRx itself requires.

Loading unpickles the file as NVRx does (``torch.load(weights_only=False)``: the job wrote
it), or in the managers' safe mode with ``torch.load(weights_only=True)``. Classes pickled
under ``nvidia_resiliency_ext.checkpointing`` load from the real package when it is
installed, else from ours; NVRx's ``BasicTensorAwareStateDict`` becomes ours (NVRx's only
held CUDA tensors, so ``restore_tensor_device`` returns them to CUDA).
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

    Trusted by default, as in NVRx's own load: the job wrote these files. ``weights_only``
    (the managers' safe mode) loads with torch's ``weights_only`` unpickler, NVRx's
    ``BasicTensorAwareStateDict`` allowed (as ours, see the module docstring; torch 2.5 and
    later: torch 2.4 cannot allow a class under another name, and refuses it); other
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
