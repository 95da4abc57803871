"""``resilient-ckpt bench --markdown`` (resilient_ckpt.cli.bench.markdown): each figure next to
its same-run reference and ratio, read the way its metric reads; the command that reproduces
the run and the machine line; nothing dated."""

from __future__ import annotations

import re

import torch

from resilient_ckpt.cli import main
from resilient_ckpt.cli.bench import command_line
from resilient_ckpt.cli.bench.markdown import render, table
from resilient_ckpt.cli.command import build_parser


def _figure(metric: str, label: str, value: float, ref: str, ref_value: float, **extra) -> dict:
    return {
        "metric": metric,
        "case": "2 ranks x 64 MiB",
        "label": label,
        "value": value,
        "reference": ref,
        "reference_value": ref_value,
        "target": extra.pop("target", ""),
        **extra,
    }


def _rows(lines: list[str]) -> list[list[str]]:
    rows = [line for line in lines if line.startswith("|")]
    cells = [[c.strip() for c in row.strip()[1:-1].split("|")] for row in rows]
    assert len({len(c) for c in cells}) == 1, rows  # every row as wide as the header
    return [c for c in cells if not c[0].startswith("---")]


def test_a_stall_figure_reads_against_its_reference_and_its_peer() -> None:
    doc = {
        "benchmark": "stall",
        "figures": [
            _figure(
                "stall",
                "ours torch",
                0.006,
                "memcpy",
                0.002,
                target="<= 1.5x",
                peer="dcp.async_save",
                peer_value=0.010,
            ),
            _figure("stall", "ours torch, overlapped call", 0.0002, "memcpy", 0.002),
        ],
    }
    head, ours, call = _rows(table(doc))
    assert head[-2:] == ["peer", "x peer"]
    assert ours == [
        "2 ranks x 64 MiB",
        "ours torch",
        "6.00 ms",
        "memcpy",
        "2.00 ms",
        "3.00x",
        "<= 1.5x",
        "dcp.async_save",
        "0.60x",
    ]
    assert call[5] == "0.10x" and call[-2:] == ["", ""]  # no peer: empty cells
    assert "lower is better" in table(doc)[-1]


def test_throughput_is_a_ratio_of_rates_and_recovery_a_speed_up() -> None:
    throughput = _figure("throughput", "local load", 1.6, "raw cold read", 2.0, target=">= 0.8x")
    recovery = _figure("recovery", "restore from memory", 0.1, "durable, cold", 0.3)
    (head, load) = _rows(table({"benchmark": "local_ckpt", "figures": [throughput]}))
    assert "peer" not in head  # no figure has one
    assert load[2:6] == ["1.60 GB/s", "raw cold read", "2.00 GB/s", "0.80x"]
    lines = table({"benchmark": "tiered_recovery", "figures": [recovery]})
    assert _rows(lines)[1][2:6] == ["100.00 ms", "durable, cold", "300.00 ms", "3.00x"]
    assert "how many times faster" in lines[-1]


def test_the_page_block_names_the_command_and_the_machine_and_nothing_dated() -> None:
    docs = [
        {"benchmark": "dcp_load", "figures": [_figure("throughput", "ours", 2.0, "torch", 1.0)]}
    ]
    text = render(docs, ["resilient-ckpt", "bench", "--markdown", "--dir", "/my disk"])
    lines = text.splitlines()
    assert lines[0] == "Command: `resilient-ckpt bench --markdown --dir '/my disk'`"
    assert lines[2].startswith("Machine: ") and f"torch {torch.__version__}" in lines[2]
    assert "state on CPU" in lines[2] and "CPUs (" in lines[2]
    assert "**DCP load** (`dcp_load`)" in lines
    assert not re.search(r"\b\d{4}-\d{2}-\d{2}\b|\b[0-9a-f]{7,40}\b", text)


def test_the_command_line_reproduces_the_run() -> None:
    argv = ["bench", "--markdown", "--only", "stall", "--", "--ranks", "1", "--reps", "2"]
    assert command_line(build_parser().parse_args(argv)) == ["resilient-ckpt", *argv]
    quick = build_parser().parse_args(["bench", "--quick", "--dir", "/d", "--markdown"])
    assert command_line(quick) == [
        *("resilient-ckpt", "bench", "--markdown", "--quick", "--dir", "/d"),
    ]


def test_json_and_markdown_together_are_refused(capsys) -> None:
    assert main(["--json", "bench", "--markdown", "--only", "stall"]) == 2
    assert "choose one" in capsys.readouterr().err
