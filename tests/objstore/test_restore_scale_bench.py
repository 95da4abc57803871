"""``resilient-ckpt bench --only restore_scale`` at its smallest (2 ranks, a tiny state): the
tables and the JSON document are there, and the byte counts say what read-once is for
(counts, not timings: read-once reads the checkpoint once, torch's reader once per rank)."""

from __future__ import annotations

import json
import os

import pytest

from resilient_ckpt.cli import main

pytestmark = [pytest.mark.objstore, pytest.mark.dist, pytest.mark.timeout(240)]

WORLD = 2


def test_restore_scale_smallest_run(capsys, tmp_path) -> None:
    argv = ["--json", "bench", "--only", "restore_scale", "--dir", str(tmp_path), "--"]
    bench = ["--ranks", str(WORLD), "--size", "256K", "--tensors", "4"]
    code = main([*argv, *bench, "--repeats", "1", "--saves", "2"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    (document,) = json.loads(captured.out)
    assert document["benchmark"] == "restore_scale"

    rows = {row["state"]: row for row in document["restore"]}
    assert set(rows) == {"pure DP", "half sharded"}
    for row in rows.values():
        assert row["world"] == WORLD and row["checkpoint_bytes"] > 0
        assert row["read_once_ratio"] <= 1.1, row
        assert row["torch_s"] > 0 and row["read_once_s"] > 0
    # torch's reader downloads every object on every rank that needs one of its items
    assert abs(rows["pure DP"]["torch_ratio"] - WORLD) <= 0.1 * WORLD, rows["pure DP"]

    (census,) = document["census"]
    assert census["world"] == WORLD and census["consistent"]
    per_rank = census["collectives_per_rank"]
    assert per_rank["plan"] >= 1 and per_rank["commit"] >= 1
    assert census["storage_per_save"]["PUT"] >= WORLD  # a data object per rank, and metadata
    assert census["metadata_bytes"] > 0 and census["coordinator_received"] > 0
    assert set(census["restores"]) == {
        f"{state}: {reader}" for state in rows for reader in ("torch reader", "read-once")
    }
    for horizon in ("1024", "16384"):
        assert document["projection"]["save_seconds"][horizon] > 0
    assert document["growth"]

    tables = captured.err
    for text in ("MB/s", "torch reader", "W=2: the collectives", "Per steady save, projected"):
        assert text in tables, text
    assert os.listdir(tmp_path) == []  # the MSC config files are gone
