"""A bandwidth limit shared by several transfers, for simulating a node's link to storage.

On a cluster a restore is limited by each node's share of the storage service: a shared
file system or an object store serves every node at some bytes per second, and the ranks of
one node share that. On one machine, the object store on loopback serves at memory speed,
which hides what a restore that reads the checkpoint once per rank costs. A :class:`Throttle`
puts the limit back: every transfer through it (each thread of every request that a node's
ranks send through the same :class:`~.fault_proxy.FaultInjectingProxy`) takes its bytes'
time on one shared timeline, so together they never pass ``rate`` bytes per second.

Decision: pacing on a shared timeline rather than a token bucket with a burst. Each chunk
reserves the next ``nbytes / rate`` seconds after the last reservation (or from now, if the
link is idle) and waits until its reservation ends, so a transfer of ``N`` bytes takes at
least ``N / rate`` seconds however many transfers run beside it, and concurrent transfers
interleave chunk by chunk, as flows on one link do. A bucket's burst would let short
transfers through at loopback speed, which is the effect being removed. Uploads and
downloads share one timeline, as a node's share of a storage service counts both.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from ..errors import ConfigurationError

__all__ = ["Throttle"]

# Chunks a transfer is paced in: small enough that concurrent transfers interleave, large
# enough that sleeping per chunk costs little.
CHUNK = 256 << 10


class Throttle:
    """At most ``rate`` bytes per second through every :meth:`take` of this object together
    (thread-safe; see the module docstring)."""

    def __init__(self, rate: float) -> None:
        if not rate > 0:
            raise ConfigurationError(f"a throttle's rate must be > 0 bytes/s, got {rate!r}")
        self.rate = float(rate)
        self._free_at = 0.0  # when the link's last reservation ends (time.monotonic)
        self._lock = threading.Lock()
        self._bytes = 0

    @property
    def bytes_passed(self) -> int:
        """Bytes that have passed through the throttle so far."""
        with self._lock:
            return self._bytes

    def take(self, nbytes: int) -> None:
        """Wait until ``nbytes`` more may pass (reserved after every earlier reservation)."""
        if nbytes <= 0:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._free_at)
            self._free_at = start + nbytes / self.rate
            ends = self._free_at
            self._bytes += nbytes
        delay = ends - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def chunks(self, data: bytes | memoryview, size: int = CHUNK) -> Iterator[memoryview]:
        """``data`` in chunks of ``size`` bytes, each yielded once the throttle lets it pass."""
        view = memoryview(data)
        for start in range(0, len(view), size):
            chunk = view[start : start + size]
            self.take(len(chunk))
            yield chunk
