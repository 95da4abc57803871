"""``resilient-ckpt bench --plot``: the benchmarks' figures against their references.

Input: the documents the benchmarks write with ``--json`` (``benchmarks/_common.Figures``),
each a list of figures ``{metric, case, label, value, reference, reference_value}``. Output:
one PNG with a panel per metric present: trainer *stall* per save (seconds, log scale, lower
is better) and *throughput* (GB/s, higher is better). Every figure is a solid bar with its
reference of the same run (the memcpy floor, ``dd``, or the peer implementation) as a grey
bar beneath it, and the ratio printed at the end, so the chart shows what the tables say.

matplotlib is an optional dependency (``pip install 'resilient-ckpt[plot]'``), imported here
only, with the non-interactive Agg backend.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigurationError

_PANELS = {
    "stall": "Trainer stall per save (s, log scale; lower is better)",
    "throughput": "Throughput (GB/s; higher is better)",
}


def _rows(results: list[dict[str, Any]], metric: str) -> list[dict[str, Any]]:
    return [
        dict(figure, benchmark=doc.get("benchmark", "?"))
        for doc in results
        for figure in doc.get("figures", [])
        if figure.get("metric") == metric
    ]


def _draw_panel(ax: Any, metric: str, rows: list[dict[str, Any]]) -> None:
    labels, positions = [], []
    for i, row in enumerate(rows):
        y = -i * 1.0
        ax.barh(y, row["value"], height=0.4, color="tab:blue")
        text = f"{row['value']:.3g}"
        if row.get("reference_value"):
            ref = row["reference_value"]
            ax.barh(y - 0.4, ref, height=0.4, color="0.7")
            ax.text(ref, y - 0.4, f" {row['reference']}: {ref:.3g}", va="center", fontsize=7)
            text += f"  ({row['value'] / ref:.2f}x)"
        ax.text(row["value"], y, " " + text, va="center", fontsize=7)
        labels.append(f"{row['benchmark']} | {row['case']} | {row['label']}")
        positions.append(y - 0.2)
    ax.set_yticks(positions, labels, fontsize=7)
    ax.set_title(_PANELS[metric], fontsize=9)
    if metric == "stall":
        ax.set_xscale("log")
    ax.margins(x=0.35)


def plot(results: list[dict[str, Any]], path: str) -> int:
    """Draw ``results`` into ``path`` (PNG); returns how many figures were drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigurationError(
            "--plot needs matplotlib: pip install 'resilient-ckpt[plot]'"
        ) from exc
    panels = [(metric, _rows(results, metric)) for metric in _PANELS]
    panels = [(metric, rows) for metric, rows in panels if rows]
    if not panels:
        raise ConfigurationError("the benchmarks reported no figures to plot")
    heights = [0.45 * len(rows) + 0.8 for _, rows in panels]
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(11, sum(heights) + 0.6),
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    for ax, (metric, rows) in zip(axes[:, 0], panels, strict=True):
        _draw_panel(ax, metric, rows)
    machine = {(doc.get("torch"), doc.get("cpus")) for doc in results}
    fig.suptitle(
        "resilient_ckpt benchmarks (blue: measured; grey: reference of the same run); "
        + ", ".join(f"torch {t}, {c} CPUs" for t, c in sorted(machine, key=str)),
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return sum(len(rows) for _, rows in panels)
