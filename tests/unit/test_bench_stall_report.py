"""The stall benchmark's tables (resilient_ckpt.cli.bench.stall_report): the reference named
for the state's device, a failed reference flow of torch's left out and said so, not a crash;
and its CPU reference copy (``stall_refs.Memcpy``), by one thread or several."""

from __future__ import annotations

import pytest
import torch

from resilient_ckpt.cli.bench.stall_refs import Memcpy
from resilient_ckpt.cli.bench.stall_report import record, report

_FLOWS = ("memcpy", "ours DCP", "ours torch", "ours local", "dcp.async_save")


def _figures(with_dcp: bool = True, cuda: bool = False) -> dict[str, float]:
    fig = {f"{flow}|stall": 0.002 * (i + 1) for i, flow in enumerate(_FLOWS)}
    for flow in ("ours DCP overlapped", "ours torch overlapped"):
        fig[f"{flow}|stall"], fig[f"{flow}|snapshot"] = 0.0005, 0.003
    if cuda:
        fig["dcp.async_save overlapped|stall"] = 0.001
        fig["dcp.async_save overlapped|snapshot"] = 0.004
    if not with_dcp:
        del fig["dcp.async_save|stall"]
    for flow in ("ours DCP", "ours torch", "ours local"):
        fig[f"{flow}|first"] = 0.004
    return fig


def test_cpu_table_divides_by_the_memcpy(capsys) -> None:
    report({"2M/64": _figures()}, 2)
    out = capsys.readouterr().out
    assert "state on cpu" in out and "x memcpy" in out and "D2H" not in out
    row = next(line for line in out.splitlines() if "ours torch  " in line)
    # 6 ms against a 2 ms memcpy and a 10 ms dcp.async_save
    assert "3.00" in row and "0.60" in row
    assert "dcp.async_save overlapped" not in out


def test_cuda_table_names_the_pinned_copy_and_torch_background_staging(capsys) -> None:
    report({"64M/2000": _figures(cuda=True)}, 1, "cuda")
    out = capsys.readouterr().out
    assert "state on cuda" in out and "x D2H" in out and "pinned host memory" in out
    overlapped = next(line for line in out.splitlines() if "dcp.async_save overlapped" in line)
    assert "4.00 ms" in overlapped and "<= 0.1x" not in overlapped  # a reference: no target


def test_a_failed_reference_is_reported_and_its_ratios_are_absent(capsys) -> None:
    failed = {"dcp.async_save": "256M/8: KeyError: <class 'type'>"}
    report({"256M/8": _figures(with_dcp=False)}, 2, "cpu", failed)
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("256M/8     ours DCP  ")]
    assert rows and rows[0].rstrip().endswith("n/a")
    assert "dcp.async_save: failed, left out (256M/8: KeyError: <class 'type'>)" in out
    figures = record({"256M/8": _figures(with_dcp=False)}, 2).items
    assert [f["label"] for f in figures] == [
        "ours DCP",
        "ours torch",
        "ours local",
        "ours DCP, overlapped call",
        "ours torch, overlapped call",
    ]
    assert not any(f["peer"] for f in figures)  # no dcp.async_save to compare with


def test_recorded_figures_carry_the_device_and_its_reference() -> None:
    items = record({"2M/64": _figures(cuda=True)}, 1, "cuda").items
    assert {f["reference"] for f in items} == {"D2H"}
    assert all(f["case"] == "2M/64 x 1 ranks (cuda)" for f in items)
    assert {f["reference"] for f in record({"2M/64": _figures()}, 2).items} == {"memcpy"}


def test_recorded_figures_of_ours_carry_dcp_async_save_and_the_overlapped_calls() -> None:
    items = {f["label"]: f for f in record({"64M/2000": _figures()}, 2).items}
    torch_flow, call = items["ours torch"], items["ours torch, overlapped call"]
    # 6 ms against a 2 ms memcpy and a 10 ms dcp.async_save (see _figures)
    assert torch_flow["peer"] == "dcp.async_save"
    assert torch_flow["peer_value"] == pytest.approx(0.010)
    assert torch_flow["reference_value"] == pytest.approx(0.002)
    assert torch_flow["target"] == "<= 1.5x"
    assert items["dcp.async_save"]["peer"] is None  # the peer is not its own peer
    assert call["value"] == 0.0005 and call["reference"] == "memcpy"
    assert call["target"] == "<= 0.1x" and call["peer"] is None


def test_a_reference_that_went_on_with_fresh_stagers_is_said_so(capsys) -> None:
    notes = {"dcp.async_save": "64M/2000: KeyError: <class 'type'>"}
    report({"64M/2000": _figures()}, 1, "cuda", {}, notes)
    out = capsys.readouterr().out
    assert "dcp.async_save: its stager failed when reused (64M/2000: KeyError" in out
    assert "left out" not in out
    assert any(line.startswith("64M/2000   dcp.async_save") for line in out.splitlines())


def test_the_parallel_copy_is_a_reference_row_only_where_it_used_several_threads(capsys) -> None:
    fig = _figures()
    fig["memcpy threads|stall"], fig["memcpy threads|threads"] = 0.0013, 2.0
    report({"256M/8": fig}, 1)
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "memcpy, 2 threads" in line)
    assert "1.30" in row and "0.65" in row and "<=" not in row  # 1.3 ms against 2 ms
    assert {f["label"] for f in record({"256M/8": fig}, 1).items} == {
        "ours DCP",
        "ours torch",
        "ours local",
        "dcp.async_save",
        "ours DCP, overlapped call",
        "ours torch, overlapped call",
    }
    fig["memcpy threads|threads"] = 1.0  # one core per rank: nothing to show
    report({"256M/8": fig}, 2)
    assert not any("memcpy, " in line for line in capsys.readouterr().out.splitlines())


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
def test_the_memcpy_reference_copies_every_byte_whatever_its_threads(threads: int) -> None:
    tensors = [torch.arange(n, dtype=torch.float32) + n for n in (5, 1, 0, 1000, 37)]
    copy = Memcpy(tensors, threads=threads)
    try:
        assert [sum(n for _, _, n in share) for share in copy.shares][:1] == [
            -(-4 * 1043 // threads)
        ]
        copy()
        expected = torch.cat([t.view(torch.uint8) for t in tensors])
        assert torch.equal(copy.base[: expected.numel()], expected)
    finally:
        copy.close()
