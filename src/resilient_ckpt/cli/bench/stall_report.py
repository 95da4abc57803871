"""The stall benchmark's output (:mod:`resilient_ckpt.cli.bench_stall`): the printed tables,
each figure against its same-run reference and target, and the figures for ``--plot``."""

from __future__ import annotations

import sys

from ._output import verdict
from .common import Figures
from .stall_flows import TELEMETRY_FLOW

# The target of each row of the table: DESIGN.md section 7 (stall; stall, small states).
TARGETS = {
    "2M/64": "<= 3 ms + 2x",
    "64M/2000": "<= 1.5x",
    "256M/8": "<= 1.3x",
    "1G/2000": "<= 1.3x",
}
OVERLAPPED_TARGET = "<= 0.1x"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.2f}"


# The rows of the main table, and the targets of the flows judged against ``dcp.async_save``
# (DESIGN.md section 7, "DCP-native"): resilient_ckpt.dcp's and torch's with our Stager.
FLOWS = (
    "ours DCP",
    "ours torch",
    "ours local",
    "ours dcp.async_save",
    "dcp.async_save + Stager",
    "dcp.async_save",
)
PEER_TARGETS = {
    "ours dcp.async_save": {"64M/2000": "<= 0.1x dcp", "1G/2000": "<= 0.1x dcp"},
    "dcp.async_save + Stager": {},
}


def _target(flow: str, shape: str) -> str:
    if flow in PEER_TARGETS:
        return PEER_TARGETS[flow].get(shape, "<= 1x dcp")
    return TARGETS[shape] if flow != "dcp.async_save" else ""


# The reference each stall is divided by, per device of the state.
REFERENCES = {
    "cpu": ("memcpy", "memcpy = one thread's memmove of the same bytes into shared memory"),
    "cuda": ("D2H", "D2H = the same tensors copied into pinned host memory (non-blocking, sync)"),
}


def _ratio(ours: float, peer: float | None, width: int) -> str:
    return f"{ours / peer:{width}.2f}" if peer else f"{'n/a':>{width}}"


def report(
    results: dict[str, dict[str, float]],
    ranks: int,
    device: str = "cpu",
    failed: dict[str, str] | None = None,
    notes: dict[str, str] | None = None,
) -> None:
    """Print the tables; ``failed`` names reference flows that raised (left out), ``notes``
    those whose reused stager raised once (each save then made its own)."""
    ref, legend = REFERENCES[device]
    print(
        f"\nStall per save at {ranks} ranks, state on {device} (ms; median over reps of the "
        f"slowest rank; {legend})",
        flush=True,
    )
    head = f"{'state/rank':<10} {'flow':<28} {'stall':>8} {ref:>8} {'x ' + ref:>8}"
    print(head + f" {'target':>13} {'':6} {'dcp.async':>9} {'x dcp':>6}")
    for shape, fig in results.items():
        copy, peer = fig["memcpy|stall"], fig.get("dcp.async_save|stall")
        for flow in FLOWS:
            if f"{flow}|stall" not in fig:
                continue
            ours = fig[f"{flow}|stall"]
            target = _target(flow, shape)
            ratio = ours / peer if target.endswith("x dcp") and peer else ours / copy
            print(
                f"{shape:<10} {flow:<28} {_ms(ours)} {_ms(copy)} {ours / copy:8.2f} "
                f"{target:>13} {verdict(target.removesuffix(' dcp'), ratio, ours, copy):6} "
                f"{_ms(peer) if peer else 'n/a':>8} {_ratio(ours, peer, 6)}"
            )
        threads = int(fig.get("memcpy threads|threads", 1))
        if threads > 1:  # what several threads gain here: the floor of the 256M/8 target
            parallel = fig["memcpy threads|stall"]
            flow = f"memcpy, {threads} threads"
            print(
                f"{shape:<10} {flow:<28} {_ms(parallel)} {_ms(copy)} {parallel / copy:8.2f} "
                f"{'':>13}   (the same copy split over our copy pool's threads)"
            )
        overlapped = (
            "ours DCP overlapped",
            "ours DCP overlapped+defer",
            "ours torch overlapped",
            "ours local overlapped",
            "ours local overlapped+defer",
            "dcp.async_save overlapped",
        )
        for flow in (f for f in overlapped if f"{f}|stall" in fig):
            ours, snap = fig[f"{flow}|stall"], fig[f"{flow}|snapshot"]
            target = OVERLAPPED_TARGET if flow.startswith("ours") else ""
            print(
                f"{shape:<10} {flow:<28} {_ms(ours)} {_ms(copy)} {ours / copy:8.2f} "
                f"{target:>13} {verdict(target, ours / copy):6}   "
                f"(call + wait for the snapshot: {_ms(snap).strip()} ms)"
            )
    _telemetry_rows(results, ref)
    for shape, fig in results.items():
        if "dcp.async_save + Stager|arenas" in fig:
            print(
                f"{shape:<10} Stager's shared-memory arenas after every save: "
                f"{int(fig['dcp.async_save + Stager|arenas'])} (its max_arenas bounds them)"
            )
    for flow, error in (notes or {}).items():
        print(
            f"{flow}: its stager failed when reused ({error}); each save since made a fresh "
            "one, its set-up included in the stall"
        )
    for flow, error in (failed or {}).items():
        print(f"{flow}: failed, left out ({error})")
    print("\nFirst save after the warm-up (median of fresh objects) / steady save (target <= 2)")
    for shape, fig in results.items():
        for flow in ("ours DCP", "ours torch", "ours local"):
            if f"{flow}|stall" not in fig:  # left out (--skip)
                continue
            first, steady = fig[f"{flow}|first"], fig[f"{flow}|stall"]
            print(
                f"{shape:<10} {flow:<28} first {_ms(first)} ms  steady {_ms(steady)} ms  "
                f"ratio {first / steady:6.2f}  {verdict('<= 2', first / steady)}"
            )
    print(
        "\nFinalize in the trainer: the non-blocking finalize call that commits a save, "
        "polled once a step as a training loop does (the background write not included; "
        "median and longest over reps, slowest rank)"
    )
    for shape, fig in results.items():
        for flow in ("ours DCP", "ours torch", "ours local"):
            if f"{flow}|finalize" in fig:
                finalize, longest = fig[f"{flow}|finalize"], fig[f"{flow}|finalize_max"]
                print(
                    f"{shape:<10} {flow:<28} median {_ms(finalize)} ms "
                    f"({finalize / fig['memcpy|stall']:.2f} x {REFERENCES[device][0]})  "
                    f"longest {_ms(longest)} ms"
                )
    for shape, fig in results.items():
        if "memory|rss_growth" in fig:
            growth, memfds = fig["memory|rss_growth"] * 100, int(fig["memory|new_memfds"])
            print(
                f"\nMemory over saves of {shape} (ours torch): peak RSS growth "
                f"{growth:.2f} % (target < 1 %: {verdict('< 1', growth)}), new staging memfds "
                f"after the first save: {memfds} (target 0: {'met' if memfds == 0 else 'MISSED'})"
            )
    sys.stdout.flush()


def _telemetry_rows(results: dict[str, dict[str, float]], ref: str) -> None:
    rows = [(s, f) for s, f in results.items() if f"{TELEMETRY_FLOW}|stall" in f]
    if not rows:
        return
    print(
        "\nTelemetry: the ours DCP stall with OpenTelemetry on in the trainer (SDK, batch span "
        "processor, spans dropped at export) / off, same run"
    )
    for shape, fig in rows:
        on, off = fig[f"{TELEMETRY_FLOW}|stall"], fig["ours DCP|stall"]
        print(
            f"{shape:<10} {'ours DCP':<28} on {_ms(on)} ms  off {_ms(off)} ms  "
            f"ratio {on / off:6.2f}  ({on / fig['memcpy|stall']:.2f} x {ref} on)"
        )


def record(results: dict[str, dict[str, float]], ranks: int, device: str = "cpu") -> Figures:
    """The stalls of the printed table, each against the reference of the same run, ours also
    against ``dcp.async_save`` where it ran, and the overlapped save calls (for
    ``resilient-ckpt bench --plot`` and ``--markdown``)."""
    ref = REFERENCES[device][0]
    figures = Figures("stall")
    for shape, fig in results.items():
        case = f"{shape} x {ranks} ranks" + (f" ({device})" if device != "cpu" else "")
        copy, peer = fig["memcpy|stall"], fig.get("dcp.async_save|stall")
        for flow in FLOWS:
            if f"{flow}|stall" not in fig:
                continue
            ours = flow != "dcp.async_save"
            figures.add(
                "stall",
                case,
                flow,
                fig[f"{flow}|stall"],
                ref,
                copy,
                _target(flow, shape),
                peer="dcp.async_save" if ours and peer else None,
                peer_value=peer if ours else None,
            )
        if f"{TELEMETRY_FLOW}|stall" in fig:
            figures.add(
                "stall",
                case,
                "ours DCP, telemetry on",
                fig[f"{TELEMETRY_FLOW}|stall"],
                ref,
                copy,
                peer="ours DCP (telemetry off)",
                peer_value=fig["ours DCP|stall"],
            )
        for flow, label in _OVERLAPPED.items():
            if f"{flow}|stall" in fig:
                target = OVERLAPPED_TARGET if flow.startswith("ours") else ""
                figures.add("stall", case, label, fig[f"{flow}|stall"], ref, copy, target)
    return figures


# The overlapped flows' save calls, as the figures name them.
_OVERLAPPED = {
    "ours DCP overlapped": "ours DCP, overlapped call",
    "ours DCP overlapped+defer": "ours DCP, overlapped call, deferred planning",
    "ours torch overlapped": "ours torch, overlapped call",
    "ours local overlapped": "ours local, overlapped call",
    "ours local overlapped+defer": "ours local, overlapped call, deferred planning",
    "dcp.async_save overlapped": "dcp.async_save, overlapped call",
}
