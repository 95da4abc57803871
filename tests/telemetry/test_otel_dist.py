"""Telemetry end to end: two gloo ranks, their workers, and a real OTLP/HTTP receiver.

The receiver (:mod:`._receiver`) runs in the test process on loopback; each rank configures
its SDK as an application would and its worker from the environment or ``otel_bootstrap``.
The same saves with the SDK impossible to import run in a subprocess whose interpreters
(ranks, workers) all block ``opentelemetry.sdk`` at import.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from resilient_ckpt import _telemetry as tm
from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, PersistentAsyncCaller
from resilient_ckpt.testing import launch

from . import _jobs
from ._receiver import Received, Receiver, Span

pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
pytest.importorskip("opentelemetry.proto")

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[2]


def _wait_for(rx: Receiver, done, timeout: float = 30.0) -> Received:
    """The receiver's records once ``done(records)`` holds (exports arrive asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        got = rx.snapshot()
        if done(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def _trainer(spans: list[Span]) -> list[Span]:
    return [s for s in spans if s.resource.get("service.name") == "trainer"]


def _named(spans: list[Span], name: str) -> list[Span]:
    return [s for s in spans if s.name == name]


def _check_worker_children(spans: list[Span], worker_service: str) -> None:
    """Every worker request span is a child of a trainer save span of the same trace, on the
    same rank; its write span is its child, and the file spans are the write's children."""
    by_id = {s.span_id: s for s in spans}
    requests = [
        s
        for s in _named(spans, tm.REQUEST_SPAN)
        if s.resource.get("service.name") == worker_service
    ]
    assert {s.attributes[tm.RANK] for s in requests} == {0, 1}
    for request in requests:
        parent = by_id[request.parent_id]
        assert parent.name == tm.SAVE_SPAN and parent.trace_id == request.trace_id
        assert parent.resource["service.name"] == "trainer"
        assert parent.attributes[tm.RANK] == request.attributes[tm.RANK]
        assert parent.attributes[tm.CALL_IDX] == request.attributes[tm.CALL_IDX]
    for write in _named(spans, tm.WRITE_SPAN):
        assert by_id[write.parent_id].name == tm.REQUEST_SPAN
    files = _named(spans, tm.FILE_SPAN)
    assert files
    for file in files:
        assert by_id[file.parent_id].name == tm.WRITE_SPAN
        assert file.attributes[tm.BYTES] > 0


def _points(got: Received, metric: str) -> list:
    return [p for p in got.points if p.metric == metric]


def _complete(got: Received, worker_service: str) -> bool:
    workers = [s for s in got.spans if s.resource.get("service.name") == worker_service]
    saves = _named(_trainer(got.spans), tm.SAVE_SPAN)
    return len(saves) >= 8 and len(_named(workers, tm.REQUEST_SPAN)) >= 8


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["env", "bootstrap"])
def test_dcp_saves_one_trace_across_the_worker(tmp_path, how) -> None:
    worker_service = "env-worker" if how == "env" else "bootstrapped-worker"
    with Receiver() as rx:
        results = launch(_jobs.dcp_saves, 2, str(tmp_path), rx.url, how, timeout=240)
        got = _wait_for(rx, lambda g: _complete(g, worker_service))
    for result in results:
        assert result["exact"] and result["failed"] is not None

    trainer = _trainer(got.spans)
    saves = _named(trainer, tm.SAVE_SPAN)
    assert sorted((s.attributes[tm.RANK], s.attributes[tm.FLOW]) for s in saves) == [
        (0, "async"),
        (0, "dcp"),
        (0, "dcp"),
        (0, "local"),
        (1, "async"),
        (1, "dcp"),
        (1, "dcp"),
        (1, "local"),
    ]
    for save in saves:
        if save.attributes[tm.FLOW] == "local":
            assert save.attributes[tm.STEP] == 7 and save.status == "STATUS_CODE_UNSET"
        elif save.attributes[tm.FLOW] == "dcp":
            assert save.status == "STATUS_CODE_UNSET"
            assert save.attributes[tm.BYTES] > 0
            assert save.attributes[tm.CHECKPOINT].startswith(str(tmp_path))
        else:  # the save whose write failed on rank 1 failed on both ranks
            assert save.status == "STATUS_CODE_ERROR"
            assert "AsyncCallFailedError" in save.attributes[tm.ERROR_TYPE]
            assert list(save.attributes[tm.FAILED_RANKS]) == [1]
    by_id = {s.span_id: s for s in got.spans}
    for name in (tm.PLAN_SPAN, tm.STAGE_SPAN, tm.FINALIZE_SPAN):
        phases = _named(trainer, name)
        assert phases, name
        assert all(by_id[p.parent_id].name == tm.SAVE_SPAN for p in phases)
    commits = _named(trainer, tm.COMMIT_SPAN)
    assert len(commits) == 4 and all(by_id[c.parent_id].name == tm.FINALIZE_SPAN for c in commits)

    _check_worker_children(got.spans, worker_service)
    failed_requests = [
        s for s in _named(got.spans, tm.REQUEST_SPAN) if s.status == "STATUS_CODE_ERROR"
    ]
    assert [s.attributes[tm.RANK] for s in failed_requests] == [1]
    assert "RuntimeError" in failed_requests[0].attributes[tm.ERROR_TYPE]

    for metric in ("resilient_ckpt.save.stall", "resilient_ckpt.save.write"):
        points = _points(got, metric)
        assert {(p.attributes[tm.RANK], p.attributes[tm.FLOW]) for p in points} >= {
            (0, "dcp"),
            (1, "dcp"),
        }, metric
    committed = _points(got, "resilient_ckpt.save.committed")
    assert sorted((p.attributes[tm.RANK], p.attributes[tm.FLOW], p.value) for p in committed) == [
        (0, "dcp", 2),
        (0, "local", 1),
        (1, "dcp", 2),
        (1, "local", 1),
    ]
    failed = _points(got, "resilient_ckpt.save.failed")
    assert sorted(p.attributes[tm.RANK] for p in failed) == [0, 1]
    assert all(p.value > 0 for p in _points(got, "resilient_ckpt.save.bytes"))
    assert _points(got, "resilient_ckpt.save.finalize")
    # The restore through our reader: its span and the bytes each rank read from storage.
    restores = _named(trainer, tm.RESTORE_SPAN)
    assert sorted(s.attributes[tm.RANK] for s in restores) == [0, 1]
    assert {s.attributes[tm.FLOW] for s in restores} == {"dcp"}
    assert all(s.attributes[tm.BYTES] > 0 for s in restores)
    read = _points(got, "resilient_ckpt.restore.bytes")
    assert sorted(p.attributes[tm.RANK] for p in read) == [0, 1]


@pytest.mark.timeout(300)
def test_tiered_saves_and_restore(tmp_path) -> None:
    with Receiver() as rx:
        results = launch(_jobs.tiered_saves, 2, str(tmp_path), rx.url, timeout=240)
        got = _wait_for(
            rx,
            lambda g: (
                len(_named(g.spans, tm.REQUEST_SPAN)) >= 4
                and len(_named(g.spans, tm.RESTORE_SPAN)) >= 2
                and len(_named(g.spans, tm.REPLICATE_SPAN)) >= 4
            ),
        )
    assert [r["restored"] for r in results] == [2, 2]
    assert all(r["exact"] for r in results)
    saves = _named(_trainer(got.spans), tm.SAVE_SPAN)
    assert sorted((s.attributes[tm.RANK], s.attributes[tm.STEP]) for s in saves) == [
        (0, 1),
        (0, 2),
        (1, 1),
        (1, 2),
    ]
    assert {s.attributes[tm.FLOW] for s in saves} == {"tiered"}
    assert all(s.status == "STATUS_CODE_UNSET" for s in saves)
    _check_worker_children(got.spans, "resilient_ckpt")
    # The memory tier's replication (the replicator thread) hangs under its save's span.
    by_id = {s.span_id: s for s in got.spans}
    replications = _named(got.spans, tm.REPLICATE_SPAN)
    assert sorted((s.attributes[tm.RANK], s.attributes[tm.STEP]) for s in replications) == [
        (0, 1),
        (0, 2),
        (1, 1),
        (1, 2),
    ]
    for replication in replications:
        save = by_id[replication.parent_id]
        assert (
            save.name == tm.SAVE_SPAN
            and save.attributes[tm.STEP] == replication.attributes[tm.STEP]
        )
        assert save.attributes[tm.RANK] == replication.attributes[tm.RANK]
    # Step 2 went durable too: the worker wrote its files to both tiers.
    dirs = {s.attributes[tm.CHECKPOINT] for s in _named(got.spans, tm.FILE_SPAN)}
    assert any(d.startswith(str(tmp_path / "durable")) for d in dirs), dirs
    assert any(d.startswith(str(tmp_path / "mem")) for d in dirs), dirs
    restores = _named(got.spans, tm.RESTORE_SPAN)
    assert sorted(s.attributes[tm.RANK] for s in restores) == [0, 1]
    assert all(s.attributes[tm.BYTES] > 0 for s in restores)
    read = _points(got, "resilient_ckpt.restore.bytes")
    assert sorted(p.attributes[tm.RANK] for p in read) == [0, 1]
    assert all(p.attributes[tm.FLOW] == "tiered" for p in read)


@pytest.mark.timeout(300)
def test_a_slow_collector_blocks_no_save_and_no_exit(tmp_path) -> None:
    # Each export request waits 60 s before the collector reads it: far past the worker's
    # exporter timeout and its bounded flush at exit.
    with Receiver(delay=60.0) as rx:
        results = launch(_jobs.saves_with_a_slow_collector, 2, str(tmp_path), rx.url, timeout=240)
        attempts = rx.attempts
    assert attempts >= 1  # the workers did try to export
    for result in results:
        # A worker's exit waits at most its flush bound (5 s) and a second; a blocked flush
        # would hold it past the collector's delay.
        assert result["close_s"] < 30, results
        assert result["saves_s"] < 60, results


def test_otel_bootstrap_keyword_as_nvrx() -> None:
    # Megatron-LM probes the keyword with inspect.signature before passing its dict.
    for fn in (
        AsyncCallsQueue.warmup_persistent_caller,
        AsyncCallsQueue.__init__,
        PersistentAsyncCaller.__init__,
    ):
        parameter = inspect.signature(fn).parameters["otel_bootstrap"]
        assert parameter.default is None
    from resilient_ckpt.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="otel_bootstrap must be a dict"):
        AsyncCallsQueue(otel_bootstrap="http://collector:4318")  # type: ignore[arg-type]


_BLOCKER = '''
import importlib.abc
import sys


class _NoOtelSdk(importlib.abc.MetaPathFinder):
    """The 'otel' extra is not installed: its packages cannot be imported."""

    def find_spec(self, name, path=None, target=None):
        if name.startswith(("opentelemetry.sdk", "opentelemetry.exporter")):
            raise ImportError(f"{name} is blocked for this test")
        return None


sys.meta_path.insert(0, _NoOtelSdk())
'''


@pytest.mark.timeout(300)
def test_saves_without_the_sdk_export_nothing(tmp_path) -> None:
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(_BLOCKER)
    script = textwrap.dedent(
        """
        import json, sys
        from resilient_ckpt.testing import launch
        from tests.telemetry import _jobs
        try:
            import opentelemetry.sdk.trace
        except ImportError:
            pass
        else:
            raise SystemExit("the blocker did not block")
        results = launch(_jobs.dcp_saves, 2, sys.argv[1], sys.argv[2], "blocked", timeout=200)
        print(json.dumps(results))
        """
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(blocker), str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")]
    )
    root = tmp_path / "ckpt"
    root.mkdir()
    with Receiver() as rx:
        done = subprocess.run(
            [sys.executable, "-c", script, str(root), rx.url],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=260,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        time.sleep(1.0)  # anything exported late would have arrived
        got = rx.snapshot()
    import json

    results = json.loads(done.stdout.strip().splitlines()[-1])
    for result in results:
        assert result["exact"]
        assert result["failed"] is not None
        assert not result["sdk_imported"]
    assert got.requests == 0
    assert "install the 'otel' extra" in done.stderr
