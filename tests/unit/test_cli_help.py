"""What a new user reads first (issue 47, point 4): ``--help`` without docstring markup,
every positional argument explained, the benchmark targets marked met or missed, progress
as a run goes, and none of torch's INFO lines from its ``dcp.async_save`` process."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resilient_ckpt.cli import bench
from resilient_ckpt.cli._help import plain
from resilient_ckpt.cli.bench._output import dropping_torch_info, verdict
from resilient_ckpt.cli.bench.stall_report import TARGETS
from resilient_ckpt.cli.command import build_parser

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


def _parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"": parser, **verbs.choices}


@pytest.mark.parametrize("verb", sorted(_parsers()))
def test_help_is_plain_and_explains_every_positional_argument(verb) -> None:
    parser = _parsers()[verb]
    text = parser.format_help()
    assert "``" not in text and ":mod:" not in text and ":class:" not in text, text
    for action in parser._actions:
        if action.option_strings or action.help == argparse.SUPPRESS:
            continue
        if action.nargs == argparse.REMAINDER:  # demo's: its own --help explains them
            continue
        assert action.help, (verb, action.dest)


def test_plain_drops_restructuredtext_markup() -> None:
    text = "``dcp.async_save`` via :mod:`.train` and :class:`~resilient_ckpt.x.Queue`"
    assert plain(text) == "dcp.async_save via train and Queue"


def test_the_cli_reference_lists_every_benchmark() -> None:
    page = (ROOT / "docs" / "cli.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| `--only NAMES`"))
    assert all(f"`{name}`" in row for name in bench.ALL_BENCHMARKS), row


@pytest.mark.parametrize(
    "target, ratio, value, reference, expected",
    [
        ("<= 1.3x", 1.2, None, None, "met"),
        ("<= 1.3x", 1.4, None, None, "MISSED"),
        (">= 0.8", 0.9, None, None, "met"),
        (">= 0.8", 0.7, None, None, "MISSED"),
        ("< 1", 1.0, None, None, "MISSED"),
        ("<= 3 ms + 2x", 9.0, 0.0035, 0.0004, "met"),  # 3.5 ms <= 3 ms + 0.8 ms
        ("<= 3 ms + 2x", 9.0, 0.0045, 0.0004, "MISSED"),
        ("", 1.0, None, None, ""),
    ],
)
def test_a_target_is_marked_met_or_missed(target, ratio, value, reference, expected) -> None:
    assert verdict(target, ratio, value, reference) == expected


def test_the_stall_targets_are_the_designs() -> None:
    # DESIGN.md section 7: "<= 1.3" at realistic shapes (256 MB per rank and up).
    assert TARGETS["256M/8"] == TARGETS["1G/2000"] == "<= 1.3x"


_CHILD = (
    "import sys\n"
    "sys.stderr.write('[0] 2026-01-01 00:00:00,000 - root - INFO - Waiting for request...\\n')\n"
    "sys.stderr.write('a real problem\\n')\n"
)


def test_torch_info_lines_of_a_child_are_dropped_and_the_rest_kept(capfd) -> None:
    with dropping_torch_info():
        subprocess.run([sys.executable, "-c", _CHILD], check=True)
        print("ours, inside", file=sys.stderr, flush=True)
    print("ours, after", file=sys.stderr, flush=True)
    err = ""
    for _ in range(200):  # the filter forwards from a thread of its own: wait for its lines
        err += capfd.readouterr().err
        if "a real problem" in err and "ours, inside" in err:
            break
        time.sleep(0.05)
    assert "a real problem" in err and "ours, inside" in err and "ours, after" in err
    assert "root - INFO" not in err
