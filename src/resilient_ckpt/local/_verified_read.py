"""Reading one local checkpoint copy, verified, at the speed of the disk.

A copy is used only after its whole byte string matched its manifest's size and CRC-32; a
mismatch raises :class:`~resilient_ckpt.errors.CorruptCheckpointError` and the manager treats
the copy as missing.

Decision: the file is *mapped* (private, copy-on-write), checksummed through the mapping
with ``MADV_SEQUENTIAL`` read-ahead, and the loaded tensors are views of it: the only passes
over the bytes are the disk's and the CRC's, with no copy out of the page cache and no
zero-filling of a fresh buffer. This is ``torch.load(mmap=True)``'s bargain:

* writes to loaded tensors go to private pages; the file never changes;
* committed copies are never modified in place (saves write new files, retention unlinks), so
  a mapping keeps the verified bytes even after deletion. A tool that rewrites a checkpoint
  file in place under a live state breaks this: ``RESILIENT_CKPT_LOCAL_LOAD_MMAP=0`` reads
  into memory instead, as does a file that cannot be mapped (empty, no ``mmap``).

One sequential pass, not threads checksumming parts: those contend on page faults and lose
read-ahead.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import torch

from .. import _checksum
from ..config import local_load_mmap
from ..errors import CorruptCheckpointError

__all__ = ["check_against_manifest", "map_private", "read_verified"]

READ_CHUNK = 64 << 20  # larger reads measured faster on a cold cache


def read_verified(path: str, size: int, crc32: int) -> torch.Tensor:
    """The bytes of ``path`` as one CPU uint8 tensor, checked against ``size`` and ``crc32``
    (``CorruptCheckpointError`` on a mismatch, ``OSError`` if unreadable)."""
    if local_load_mmap():
        mapped = _map_verified(path, size, crc32)
        if mapped is not None:
            return mapped
    return _read_into_memory(path, size, crc32)


def check_against_manifest(path: str, got: int, value: int, size: int, crc32: int) -> None:
    """Raise ``CorruptCheckpointError`` unless ``got`` bytes with CRC ``value`` match."""
    if got != size:
        raise CorruptCheckpointError(
            f"{path}: size differs from its manifest (expected {size} bytes)", path=path
        )
    if value != crc32:
        raise CorruptCheckpointError(
            f"{path}: checksum mismatch (crc32 {value:#010x}, manifest says {crc32:#010x})",
            path=path,
        )


def map_private(path: str, size: int, expected_crc: int) -> mmap.mmap | None:
    """A private (copy-on-write) mapping of ``path``; None if it is empty or cannot be mapped.

    Raises ``CorruptCheckpointError`` if its size is not the manifest's ``size``, ``OSError``
    if it cannot be opened.
    """
    with open(path, "rb") as f:
        actual = os.fstat(f.fileno()).st_size
        if actual != size:
            check_against_manifest(path, actual, 0, size, expected_crc)
        if size == 0:
            return None
        try:
            return mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        except (OSError, ValueError):
            return None


def _map_verified(path: str, size: int, expected_crc: int) -> torch.Tensor | None:
    """The verified file as a tensor over a private mapping; None if it cannot be mapped."""
    mapping = map_private(path, size, expected_crc)
    if mapping is None:
        return None
    try:
        _advise(mapping, "MADV_SEQUENTIAL")
        with memoryview(mapping) as view:
            value = _checksum.crc32(view)
        check_against_manifest(path, size, value, size, expected_crc)
        _advise(mapping, "MADV_NORMAL")  # training touches the tensors in any order
        return torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
    except BaseException:
        mapping.close()
        raise


def _advise(mapping: mmap.mmap, name: str) -> None:
    advice = getattr(mmap, name, None)
    if advice is not None:
        try:
            mapping.madvise(advice)
        except OSError:
            pass  # advice only; some file systems refuse it


def _read_into_memory(path: str, size: int, expected_crc: int) -> torch.Tensor:
    """``readinto`` one new buffer in large chunks, the CRC of each chunk in a helper thread."""
    out = torch.empty(size, dtype=torch.uint8)
    array: Any = out.numpy()
    view = memoryview(array).cast("B")
    crc = _checksum.CrcPipe()
    got = 0
    try:
        with open(path, "rb", buffering=0) as f:
            for start in range(0, size, READ_CHUNK):
                chunk = view[start : start + READ_CHUNK]
                n = f.readinto(chunk) or 0
                if n:
                    crc.feed(chunk[:n])
                got += n
                if n < len(chunk):
                    break
            extra = f.read(1)
    finally:
        value = crc.result()
    check_against_manifest(path, got if not extra else got + 1, value, size, expected_crc)
    return out
