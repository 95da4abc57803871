"""``resilient-ckpt bench --markdown``: the run's figures as Markdown tables, for a docs page.

Input: the documents the benchmarks write with ``--json`` (:class:`.common.Figures`), the
same the plot reads. Output: the command that reproduces the run, one line about the machine
it ran on, and one table per benchmark, every figure next to its reference of the same run
and their ratio, as the printed tables give them. Nothing else: no date, no revision, no
earlier runs, so a page made from it says only what the command measures and a rerun
replaces it whole.

How a ratio reads depends on the figure's metric, and the table's legend says so:

* ``stall`` (seconds, lower is better): figure / reference, e.g. ``1.37x`` the memcpy;
* ``throughput`` (GB/s, higher is better): figure / reference;
* ``recovery`` (seconds, lower is better): reference / figure, how many times faster the
  figure is than its reference, which is how the tiered recovery target (``>= 3x``) reads.

A figure with a *peer* (the stall benchmark's ``dcp.async_save`` of the same shape) gets a
second ratio, figure / peer, in a column of its own.
"""

from __future__ import annotations

import os
import platform
import shlex
from collections.abc import Sequence
from typing import Any

_TITLES = {
    "stall": "Trainer stall per save",
    "local_ckpt": "Local checkpoints: save, load and recovery",
    "dcp_load": "DCP load",
    "tiered_recovery": "Tiered checkpoints: save stall and recovery",
}

_LEGEND = {
    "stall": "stall: figure / reference, lower is better",
    "throughput": "throughput: figure / reference (GB/s), higher is better",
    "recovery": "recovery: reference time / figure time, how many times faster",
}


def _value(metric: str, value: float) -> str:
    if metric == "throughput":
        return f"{value:.2f} GB/s"
    return f"{value * 1e3:.2f} ms"


def _ratio(metric: str, value: float, reference: float | None) -> str:
    if not reference or not value:
        return ""
    return f"{reference / value if metric == 'recovery' else value / reference:.2f}x"


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|") if text not in (None, "") else ""


def table(document: dict[str, Any]) -> list[str]:
    """One benchmark's figures as a Markdown table (lines), with its legend."""
    figures = document.get("figures", [])
    peers = any(f.get("peer") for f in figures)
    head = ["case", "figure", "value", "reference", "reference value", "ratio", "target"]
    head += ["peer", "x peer"] if peers else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for f in figures:
        metric, ref = f["metric"], f.get("reference_value")
        row = [
            f["case"],
            f["label"],
            _value(metric, f["value"]),
            f.get("reference") or "",
            _value(metric, ref) if ref else "",
            _ratio(metric, f["value"], ref),
            f.get("target") or "",
        ]
        if peers:
            peer = f.get("peer_value")
            row += [f.get("peer") or "", f"{f['value'] / peer:.2f}x" if peer else ""]
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    used = sorted({f["metric"] for f in figures})
    legend = "; ".join(_LEGEND.get(m, m) for m in used)
    return [*lines, "", f"Ratios, {legend}."]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(results: Sequence[dict[str, Any]]) -> str:
    """CPU count and model, torch, and the device the states lived on."""
    import torch

    device = "CPU"
    if any(doc.get("device") == "cuda" for doc in results) and torch.cuda.is_available():
        device = f"CUDA ({torch.cuda.get_device_name(0)})"
    return (
        f"{os.cpu_count()} CPUs ({_cpu_model()}), torch {torch.__version__}, "
        f"Python {platform.python_version()}, state on {device}"
    )


def render(results: Sequence[dict[str, Any]], command: Sequence[str]) -> str:
    """The whole Markdown block: command, machine, a table per benchmark."""
    out = [f"Command: `{shlex.join(command)}`", "", f"Machine: {machine(results)}."]
    for doc in results:
        name = doc.get("benchmark", "?")
        out += ["", f"**{_TITLES.get(name, name)}** (`{name}`)", "", *table(doc)]
    return "\n".join(out) + "\n"
