"""CRC-32 of checkpoint bytes, with the fastest implementation that is installed.

Every local and tiered checkpoint byte is checksummed when written, read or received, and
every async DCP data file when written and verified, so the CRC's speed bounds those paths;
``zlib.crc32`` can be slower than reading the same bytes from a fast SSD. ISA-L (``isal``)
and zlib-ng compute the *same* CRC-32 (zlib's polynomial, initial value and final xor) with
carry-less multiplication and release the GIL like zlib. The first importable one is used
(ISA-L, zlib-ng, zlib), chosen once at import so one file's write and check never switch
implementations; a checkpoint written with one verifies with any other, so the optional
``fast`` extra never invalidates one.
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
