"""Where each staged storage goes in the arena, and the byte ranges that fill it.

Decision: **host storages that lie close together in memory keep their relative places in
the arena, and are copied as one range, the gaps between them included.** A state of
thousands of small tensors allocated one after another (a model's parameters at start-up,
an optimizer's moments at its first step) sits in memory as storages separated by the
allocator's headers and alignment (64-448 bytes between 32 KB tensors here). Placed back to
back in the arena, each storage is a ``memmove`` of its own: ~1 us of call each, and the
copy streams through memory in the order the state was met rather than in address order.
Mirrored, the same bytes are one ``memmove`` per run of neighbours (one for the whole
64 MB / 2000-tensor state of the stall benchmark: 0.75x the time of 2000 calls, measured
here), and the copy threads split runs by bytes as before (:mod:`._copy`).

Rules:

* Host storages are sorted by address and grouped into *runs*: a storage joins the run
  before it if it starts at most ``BRIDGE_MAX_BYTES`` after the run's end (or overlaps it:
  two storage objects over the same memory share those bytes) and the gap is at most a
  sixteenth of the two neighbours' bytes, so the arena grows by at most an eighth of the
  state however small its tensors are.
* **Reading a gap is safe**: it is shorter than the smallest page (4 KiB), so each of its
  bytes lies on the page of the last byte of the storage before it or on the page of the
  first byte of the storage after it, both mapped while their storages are alive (the copy
  keeps them alive). The gap's bytes are copied but never read back: each rebuilt tensor
  sees only its own slot.
* A run starts at an arena offset with the alignment of its first source address modulo
  64, so every storage keeps its source alignment (the plain layout aligned each slot to
  64 bytes, which torch's allocator also does).
* Device storages and empty ones follow, each at a 64-byte boundary, in the order met.

Alternatives rejected: coalescing only exactly adjacent storages (what :func:`._copy.coalesce`
does) never merges two allocations of the CPU allocator, whose chunks carry headers; copying
the gap-free bytes with a gather in native code would need a compiled extension.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# At most this many bytes between two host storages copied as one range; below the 4 KiB
# page of every platform torch runs on (see the module docstring).
BRIDGE_MAX_BYTES = 1024
ALIGN = 64


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Placement:
    """``offsets[i]``: storage i's place in an arena of ``total`` bytes. ``runs``: the host
    copy as ``(arena offset, source address, bytes)`` ranges, in address order."""

    total: int
    offsets: tuple[int, ...]
    runs: tuple[tuple[int, int, int], ...]


def _bridgeable(gap: int, before: int, after: int) -> bool:
    return gap <= BRIDGE_MAX_BYTES and gap * 16 <= before + after


def place(storages: Sequence[tuple[int | None, int]]) -> Placement:
    """Place storages given as ``(host address, or None for a device storage, bytes)``."""
    offsets = [0] * len(storages)
    host = sorted(
        (address, i, nbytes)
        for i, (address, nbytes) in enumerate(storages)
        if address is not None and nbytes
    )
    runs: list[tuple[int, int, int]] = []
    cursor = 0
    start = end = previous = 0
    for address, i, nbytes in host:
        if runs and _bridgeable(address - end, previous, nbytes):
            end = max(end, address + nbytes)
        else:
            if runs:
                runs[-1] = (runs[-1][0], start, end - start)
                cursor = runs[-1][0] + end - start
            start, end = address, address + nbytes
            runs.append((align(cursor) + start % ALIGN, start, 0))
        offsets[i] = runs[-1][0] + address - start
        previous = nbytes
    if runs:
        runs[-1] = (runs[-1][0], start, end - start)
        cursor = runs[-1][0] + end - start
    cursor = align(cursor)
    for i, (where, size) in enumerate(storages):
        if where is None or not size:
            offsets[i] = cursor
            cursor += align(size)
    return Placement(cursor, tuple(offsets), tuple(runs))
