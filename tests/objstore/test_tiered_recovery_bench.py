"""``resilient-ckpt bench --only tiered_recovery -- --durable s3`` at its smallest (2 ranks,
1 MiB per rank): the durable tier is the bandwidth-limited object store of ``restore_scale``,
the printed table states the limit, and the JSON document carries the recovery figures against
the durable restore from the store (structure and byte counts, not timings)."""

from __future__ import annotations

import json
import os

import pytest

from resilient_ckpt.cli import main

pytestmark = [pytest.mark.objstore, pytest.mark.dist, pytest.mark.timeout(300)]

WORLD, SIZE_MIB, RATE = 2, 1, 50_000_000


def test_tiered_recovery_against_the_limited_store(capsys, tmp_path) -> None:
    argv = ["--json", "bench", "--only", "tiered_recovery", "--dir", str(tmp_path), "--"]
    bench = ["--durable", "s3", "--node-rate", str(RATE), "--ranks", str(WORLD)]
    code = main([*argv, *bench, "--size-mib", str(SIZE_MIB), "--repeats", "1"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    (document,) = json.loads(captured.out)
    assert document["benchmark"] == "tiered_recovery"
    assert (document["durable"], document["node_rate"]) == ("s3", RATE)
    assert document["ranks_per_node"] == WORLD // 2

    raw = document["raw"]
    # The reference downloads each rank's data object once: every rank's state, and a
    # little more (the records' headers and alignment), never a second copy.
    assert WORLD * (SIZE_MIB << 20) <= raw["durable_bytes"] < 2 * WORLD * (SIZE_MIB << 20)
    for key in ("restore_memory", "restore_restart", "restore_durable", "raw_read_durable"):
        assert raw[key] > 0, key

    figures = {f["label"]: f for f in document["figures"]}
    lost = figures["restore from memory, node lost"]
    assert lost["metric"] == "recovery" and lost["target"] == ">= 3x"
    assert lost["reference"] == "durable on S3, 50 MB/s per node"
    assert lost["value"] == raw["restore_memory"]
    assert lost["reference_value"] == raw["restore_durable"]
    assert lost["case"] == f"{WORLD} ranks x {SIZE_MIB} MiB, durable on S3 at 50 MB/s per node"
    restart = figures["restore from memory, restart"]
    assert restart["reference"] == lost["reference"]

    tables = captured.err
    for text in (
        "limited to 50 MB/s (uploads and downloads together). Why:",
        "restore same step, durable (S3), cold",
        "raw download of the same objects",
        "link time: a node's bytes / node rate",
        "of the durable restore (target: at most 1/3",
    ):
        assert text in tables, text
    assert os.listdir(tmp_path) == []  # the durable tier's config files are gone
