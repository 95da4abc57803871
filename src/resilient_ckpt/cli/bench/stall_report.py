"""The stall benchmark's output (:mod:`resilient_ckpt.cli.bench_stall`): the printed tables,
each figure against its same-run reference and target, and the figures for ``--plot``."""

from __future__ import annotations

import sys

from .common import Figures

# The target of each row of the table (issue 13).
TARGETS = {"2M/64": "<= 3 ms + 2x", "64M/2000": "<= 1.5x", "256M/8": "<= 0.7x"}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.2f}"


def report(results: dict[str, dict[str, float]], ranks: int) -> None:
    print(
        f"\nStall per save at {ranks} ranks (ms; median over reps of the slowest rank)", flush=True
    )
    head = f"{'state/rank':<10} {'flow':<22} {'stall':>8} {'memcpy':>8} {'x memcpy':>8}"
    print(head + f" {'target':>13} {'dcp.async':>9} {'x dcp':>6}")
    for shape, fig in results.items():
        copy, peer = fig["memcpy|stall"], fig["dcp.async_save|stall"]
        for flow in ("ours DCP", "ours torch", "ours local", "dcp.async_save"):
            ours = fig[f"{flow}|stall"]
            print(
                f"{shape:<10} {flow:<22} {_ms(ours)} {_ms(copy)} {ours / copy:8.2f} "
                f"{TARGETS[shape] if flow != 'dcp.async_save' else '':>13} {_ms(peer)} "
                f"{ours / peer:6.2f}"
            )
        for flow in ("ours DCP overlapped", "ours torch overlapped"):
            ours, snap = fig[f"{flow}|stall"], fig[f"{flow}|snapshot"]
            print(
                f"{shape:<10} {flow:<22} {_ms(ours)} {_ms(copy)} {ours / copy:8.2f} "
                f"{'<= 0.1x':>13}   (call + wait_for_snapshot: {_ms(snap).strip()} ms)"
            )
    print("\nFirst save after the warm-up (median of fresh objects) / steady save (target <= 2)")
    for shape, fig in results.items():
        for flow in ("ours DCP", "ours torch", "ours local"):
            first, steady = fig[f"{flow}|first"], fig[f"{flow}|stall"]
            print(
                f"{shape:<10} {flow:<22} first {_ms(first)} ms  steady {_ms(steady)} ms  "
                f"ratio {first / steady:6.2f}"
            )
    for shape, fig in results.items():
        if "memory|rss_growth" in fig:
            print(
                f"\nMemory over saves of {shape} (ours torch): peak RSS growth "
                f"{fig['memory|rss_growth'] * 100:.2f} % (target < 1 %), new staging memfds "
                f"after the first save: {int(fig['memory|new_memfds'])} (target 0)"
            )
    sys.stdout.flush()


def record(results: dict[str, dict[str, float]], ranks: int) -> Figures:
    """The stalls of the printed table, each against the memcpy of the same run (for
    ``resilient-ckpt bench --plot``)."""
    figures = Figures("stall")
    for shape, fig in results.items():
        for flow in ("ours DCP", "ours torch", "ours local", "dcp.async_save"):
            target = TARGETS[shape] if flow != "dcp.async_save" else ""
            figures.add(
                "stall",
                f"{shape} x {ranks} ranks",
                flow,
                fig[f"{flow}|stall"],
                "memcpy",
                fig["memcpy|stall"],
                target,
            )
    return figures
