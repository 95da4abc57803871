"""CRC-32 of checkpoint bytes, with the fastest implementation that is installed.

Every local and tiered checkpoint byte is checksummed when it is written, read or received,
and every async DCP data file while it is written and when ``verify`` reads it, so the
CRC's speed bounds the speed of those loads and writes: ``zlib.crc32`` (the standard
library; zlib 1.2.x computes about 1 byte per cycle) is slower than a disk read of the same
bytes on a fast SSD or from the host's cache. ISA-L (``isal``) and zlib-ng compute the
*same* CRC-32 (polynomial, initial value and final xor of zlib's) with carry-less
multiplication, several times faster, and release the GIL like zlib. Whichever is
importable is used (ISA-L first); checkpoints written with one verify with any other, so
installing or removing the optional ``fast`` extra never invalidates a checkpoint.

The choice is made once, at import: a library must not switch implementations between the
write and the check of one file for no reason a user could see.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["IMPLEMENTATION", "CrcPipe", "crc32", "implementations"]

Crc32 = Callable[[Any, int], int]


def implementations() -> dict[str, Crc32]:
    """Every importable CRC-32 implementation, fastest first (``zlib`` always last)."""
    found: dict[str, Crc32] = {}
    try:
        from isal import isal_zlib

        found["isal"] = isal_zlib.crc32
    except ImportError:
        pass
    try:
        from zlib_ng import zlib_ng

        found["zlib-ng"] = zlib_ng.crc32
    except ImportError:
        pass
    found["zlib"] = zlib.crc32
    return found


IMPLEMENTATION, _CRC32 = next(iter(implementations().items()))


def crc32(data: Any, value: int = 0) -> int:
    """zlib's CRC-32 of ``data`` (any buffer), continuing from ``value``."""
    return _CRC32(data, value)


class CrcPipe:
    """CRC-32 of a byte stream, computed in a helper thread, in submission order.

    The caller feeds each chunk right after writing or reading it, so the checksum of one
    chunk overlaps the I/O of the next (both release the GIL).
    """

    def __init__(self) -> None:
        self.value = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="resilient_ckpt-crc")
        self._last: Any = None

    def _step(self, view: memoryview) -> None:
        self.value = crc32(view, self.value)

    def feed(self, view: memoryview) -> None:
        self._last = self._pool.submit(self._step, view)

    def result(self) -> int:
        self._pool.shutdown(wait=True)
        if self._last is not None:
            self._last.result()
        return self.value
