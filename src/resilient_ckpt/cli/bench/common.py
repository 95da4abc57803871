"""Shared helpers for the benchmarks: size parsing, medians, table printing, raw references.

Cold reads. A load is compared with a raw read of the same files *from the disk*, not from
the page cache. ``/proc/sys/vm/drop_caches`` needs root and drops every file of the machine;
instead :func:`evict` syncs each file and asks the kernel to drop its cached pages
(``posix_fadvise(POSIX_FADV_DONTNEED)``), which any user may do for files they can open and
which the kernel honours for clean pages.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().rstrip("B").rstrip("I")
    if text and text[-1] in _UNITS:
        return int(float(text[:-1]) * _UNITS[text[-1]])
    return int(text)


def human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.2f} GiB"


def make_state(nbytes: int, tensor_bytes: int = 64 << 20) -> dict[str, torch.Tensor]:
    """A state dict of float32 tensors totalling ``nbytes`` (at most 64 MiB each)."""
    state: dict[str, torch.Tensor] = {}
    remaining, i = nbytes, 0
    while remaining > 0:
        chunk = min(tensor_bytes, remaining)
        state[f"layer{i:03d}.weight"] = torch.randn(chunk // 4)
        remaining -= chunk
        i += 1
    return state


def median_time(
    fn: Callable[[], object],
    repeats: int,
    warmup: int = 1,
    after: Callable[[], object] | None = None,
) -> float:
    """Median wall time of ``fn`` (``after`` runs untimed after each call)."""
    samples = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        if after is not None:
            after()
        if i >= warmup:
            samples.append(elapsed)
    return statistics.median(samples)


def dd_write_seconds(directory: str, nbytes: int) -> float:
    """Raw sequential write of ``nbytes`` with fsync (``dd ... conv=fsync``) on ``directory``."""
    path = os.path.join(directory, "dd_reference")
    count = max(1, nbytes // (8 << 20))
    start = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=8M", f"count={count}", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    elapsed = time.perf_counter() - start
    os.unlink(path)
    return elapsed * nbytes / (count * (8 << 20))


def evict(paths: Sequence[str]) -> None:
    """Make the next read of ``paths`` come from the disk (see the module docstring)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(paths: Sequence[str]) -> None:
    """Read ``paths`` sequentially into one reused 8 MiB buffer (what ``dd bs=8M`` does)."""
    buffer = memoryview(bytearray(8 << 20))
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(str(h).ljust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))


class Figures:
    """The figures of one run, for ``--json PATH`` (read by ``resilient-ckpt bench --plot``).

    Each figure is a measured value with the reference it is compared to in the printed
    table (same run, same bytes): ``metric`` is ``"stall"`` (seconds, lower is better) or
    ``"throughput"`` (GB/s, higher is better); ``case`` says which size or world size. A
    figure may also name a *peer*, another implementation of the same save measured in the
    same run (``dcp.async_save``), for a second ratio.
    """

    def __init__(self, benchmark: str) -> None:
        self.benchmark = benchmark
        self.items: list[dict[str, Any]] = []

    def add(
        self,
        metric: str,
        case: str,
        label: str,
        value: float,
        reference: str | None = None,
        reference_value: float | None = None,
        target: str = "",
        peer: str | None = None,
        peer_value: float | None = None,
    ) -> None:
        if metric not in ("stall", "throughput"):
            raise ValueError(f"metric must be 'stall' or 'throughput', got {metric!r}")
        self.items.append(
            {
                "metric": metric,
                "unit": "s" if metric == "stall" else "GB/s",
                "case": case,
                "label": label,
                "value": value,
                "reference": reference,
                "reference_value": reference_value,
                "target": target,
                "peer": peer,
                "peer_value": peer_value,
            }
        )

    def write(self, path: str | None, **context: Any) -> None:
        if not path:
            return
        document = {
            "benchmark": self.benchmark,
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            **context,
            "figures": self.items,
        }
        with open(path, "w") as f:
            json.dump(document, f, indent=2)
