"""The tiered recovery benchmark's report with its durable tier on the limited object store
(``--durable s3``): the ratio against the 1/3 target, the link time and the break-even rate
it prints, and the exit code and advice when the store's packages are missing."""

from __future__ import annotations

import importlib.util

import pytest

from resilient_ckpt.cli.bench import tiered_recovery

pytestmark = pytest.mark.timeout(30)

MIB = 1 << 20


def _results(restore_memory: float, restore_durable: float) -> dict:
    return {
        "memcpy": 0.01,
        "stall_memory": 0.02,
        "stall_durable": 0.021,
        "restore_restart": 0.1,
        "restore_memory": restore_memory,
        "restore_durable": restore_durable,
        "raw_read_durable": 3.5,
        "durable_bytes": 4 * 64 * MIB,  # 4 ranks' objects: 2 x 64 MiB per node
        "step": 8,
    }


def _report(capsys, results: dict, rate: str = "16000000") -> str:
    args = tiered_recovery._parse(["--durable", "s3", "--node-rate", rate])
    tiered_recovery._print(args, results)
    return capsys.readouterr().out


def test_the_s3_report_states_the_limit_the_link_time_and_the_target(capsys) -> None:
    out = _report(capsys, _results(restore_memory=0.4, restore_durable=10.0))
    assert "each simulated node of 2 ranks behind its own proxy limited to 16 MB/s" in out
    link = next(line for line in out.splitlines() if line.startswith("link time"))
    # a node's 128 MiB at 16 MB/s
    assert f"{128 * MIB / 16e6 * 1e3:.2f}" in link
    assert "takes 0.040 of the durable restore (target: at most 1/3, met)" in out
    # 128 MiB / (3 x 0.4 s) = 112 MB/s: above it, the link alone no longer makes durable 3x
    assert "node rates up to 112 MB/s" in out
    assert "durable = 25.00x this" in out


def test_a_memory_restore_above_a_third_is_reported_as_not_met(capsys) -> None:
    out = _report(capsys, _results(restore_memory=4.0, restore_durable=10.0))
    assert "takes 0.400 of the durable restore (target: at most 1/3, NOT met)" in out


def test_the_disk_report_is_unchanged_by_the_s3_mode(capsys) -> None:
    args = tiered_recovery._parse([])
    tiered_recovery._print(args, _results(restore_memory=0.4, restore_durable=1.0))
    out = capsys.readouterr().out
    assert "durable cold = 2.50x this" in out and "restore same step, durable, cold cache" in out
    assert "MB/s" not in out and "link time" not in out and "1/3" not in out


def test_without_moto_the_s3_mode_exits_2_saying_what_to_install(monkeypatch, capsys) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args, **kwargs):
        return None if name == "moto" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert tiered_recovery.main(["--durable", "s3"]) == 2
    err = capsys.readouterr().err
    assert "moto[server]" in err and "pip install" in err


@pytest.mark.parametrize("bad", [["--node-rate", "0"], ["--durable", "nfs"]])
def test_bad_options_are_refused(bad, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        tiered_recovery._parse(["--durable", "s3", *bad])
    assert exc.value.code == 2
    assert bad[0] in capsys.readouterr().err
