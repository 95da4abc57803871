"""What a benchmark run tells the person watching it, besides its tables.

* **Progress.** A run takes minutes; :func:`progress` prints one line on stderr as each
  part starts (stderr, so that ``--json`` and ``--markdown`` keep stdout to themselves, and
  the tables, which go to stdout or stderr as the command chose, stay whole).
* **Verdicts.** Each printed target is followed by whether the figure met it
  (:func:`verdict`), so a reader need not do the arithmetic; targets are DESIGN.md
  section 7's.
* **Quiet peers.** torch's process-based ``dcp.async_save`` (a reference flow) starts a
  subprocess that sets its root logger to INFO and logs every request on the stderr it
  inherited. :func:`dropping_torch_info` runs a block with stderr going through a filter
  that drops those lines and passes everything else, so a subprocess started inside keeps
  the filter for its lifetime.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from collections.abc import Iterator

_TARGET = re.compile(
    r"^\s*(?P<op><=|>=|<)\s*(?:(?P<ms>[0-9.]+)\s*ms\s*\+\s*)?(?P<bound>[0-9.]+)\s*(?P<unit>x|%)?\s*$"
)


def progress(text: str) -> None:
    """One line on stderr saying what the run does now."""
    print(f"[bench] {text}", file=sys.stderr, flush=True)


def verdict(
    target: str, ratio: float, value_s: float | None = None, reference_s: float | None = None
) -> str:
    """``"met"`` or ``"MISSED"`` for ``ratio`` against ``target`` (``"<= 1.3x"``,
    ``">= 0.9"``, ``"<= 3 ms + 2x"``: then ``value_s`` must be at most 3 ms plus twice
    ``reference_s``); ``""`` for no target or one this cannot read."""
    match = _TARGET.match(target or "")
    if match is None:
        return ""
    bound, op = float(match["bound"]), match["op"]
    if match["ms"] is not None:
        if value_s is None or reference_s is None:
            return ""
        ok = value_s <= float(match["ms"]) / 1e3 + bound * reference_s
    elif op == "<=":
        ok = ratio <= bound
    elif op == "<":
        ok = ratio < bound
    else:
        ok = ratio >= bound
    return "met" if ok else "MISSED"


_TORCH_INFO = re.compile(rb"^\[\d+\] \S+ \S+ - root - INFO - ")


def _forward(source: int, sink: int) -> None:
    with os.fdopen(source, "rb", buffering=0) as lines, os.fdopen(sink, "wb") as out:
        pending = b""
        while chunk := lines.read(65536):
            pending += chunk
            *whole, pending = pending.split(b"\n")
            kept = [line + b"\n" for line in whole if not _TORCH_INFO.match(line)]
            if kept:
                out.write(b"".join(kept))
                out.flush()
        if pending and not _TORCH_INFO.match(pending):
            out.write(pending)


@contextlib.contextmanager
def dropping_torch_info() -> Iterator[None]:
    """Within: this process's stderr (fd 2) through a filter dropping torch's root-logger
    INFO lines; processes started within keep it (see the module docstring)."""
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    sink = os.dup(2)
    saved = os.dup(2)
    threading.Thread(
        target=_forward, args=(read_end, sink), name="resilient_ckpt-bench-stderr", daemon=True
    ).start()
    os.dup2(write_end, 2)
    os.close(write_end)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
