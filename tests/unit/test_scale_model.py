"""The pieces of the restore_scale benchmark that need no ranks: the alpha-beta model, the
fit that projects a census, and the reading of the proxies' request logs."""

from __future__ import annotations

import math

import pytest

from resilient_ckpt.cli.bench._s3_nodes import storage_ops
from resilient_ckpt.cli.bench._scale_model import Line, Network, Term, cost, grows, hops

pytestmark = pytest.mark.timeout(30)

NET = Network(alpha=1e-5, beta=1e-9)


def test_small_collectives_cost_log_depth_and_rings_cost_a_hop_per_rank() -> None:
    assert hops(2) == 1 and hops(1024) == 10 and hops(16384) == 14 and hops(1000) == 10
    assert cost("all_reduce", 1024, 8, NET) == pytest.approx(2 * 10 * (1e-5 + 8e-9))
    assert cost("broadcast", 16384, 0, NET) == pytest.approx(14e-5)
    tree = cost("all_gather", 1024, 32, NET)
    assert tree == pytest.approx(10e-5 + 1023 * 32e-9)
    assert cost("all_gather", 1024, 32, NET, ring=True) == pytest.approx(1023e-5 + 1023 * 32e-9)
    # what a gather brings to the coordinator grows with the group, the hops with its log
    assert cost("gather", 16384, 1000, NET) == pytest.approx(14e-5 + 16383 * 1000e-9)
    assert cost("p2p", 8, 1 << 20, NET) == pytest.approx(1e-5 + (1 << 20) * 1e-9)


def test_the_fit_and_the_projection() -> None:
    line = Line.fit([(2, 10.0), (4, 14.0), (8, 22.0)])
    assert math.isclose(line.slope, 2.0) and math.isclose(line.intercept, 6.0)
    assert Line.fit([(4, 7.0)]) == Line(7.0, 0.0)
    once = ((2, 1), (8, 1))
    growing = Term("commit", "gather", "gather", "default", once, ((2, 100), (8, 160)))
    assert growing.payload(1024) == pytest.approx(100 + 10 * (1024 - 2))
    assert growing.payload_grows() and not growing.count_grows()
    # a shrinking payload (a rank's share of deduplicated items) is held, not driven to zero
    shrinking = Term(
        "commit", "gather", "gather", "default", ((2, 1), (8, 1)), ((2, 1500), (8, 1200))
    )
    assert shrinking.payload(16384) == 1200 and not shrinking.payload_grows()
    assert shrinking.seconds(1024, NET) == pytest.approx(cost("gather", 1024, 1200, NET))
    assert not grows([(2, 24), (16, 25)], 16, 0.05)  # a pickled integer's extra byte
    assert grows([(2, 24), (16, 24 + 8 * 14)], 16, 0.05)


def test_object_operations_are_read_from_the_request_log() -> None:
    log = [
        ("PUT", "/bucket/w4/census/save2/__0_0.distcp", "forwarded"),
        ("PUT", "/bucket/w4/census/save2/__1_0.distcp", "forwarded"),
        ("HEAD", "/bucket/w4/census/save2/.metadata", "forwarded"),
        ("GET", "/bucket?list-type=2&prefix=w4%2Fcensus%2Fsave2%2F", "forwarded"),
        ("POST", "/bucket/w4/census/save3/big.distcp?uploads", "forwarded"),
        ("PUT", "/bucket/w4/census/save3/big.distcp?partNumber=1&uploadId=x", "forwarded"),
        ("POST", "/bucket/w4/census/save3/big.distcp?uploadId=x", "forwarded"),
        ("DELETE", "/bucket/w4/census/save30/x", "forwarded"),
        ("GET", "/bucket/w4/restore/dp/__0_0.distcp", "forwarded"),
    ]
    ops = storage_ops(log, r"^w4/census/save(\d+)(?:/|$)")
    assert dict(ops["2"]) == {"PUT": 2, "HEAD": 1, "LIST": 1}
    assert dict(ops["3"]) == {"multipart start": 1, "PUT part": 1, "multipart complete": 1}
    assert dict(ops["30"]) == {"DELETE": 1}
    assert set(ops) == {"2", "3", "30"}
