"""The telemetry module on its own: what turns the worker's export on, the bootstrap's
checks, and the trainer's off path (nothing imported, nothing recorded)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from resilient_ckpt import _telemetry as tm
from resilient_ckpt._telemetry import _trainer, _worker
from resilient_ckpt.errors import ConfigurationError

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "env, on",
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:1"}, False),
        ({"OTEL_SERVICE_NAME": "only-a-name"}, False),
    ],
)
def test_what_turns_the_workers_export_on(env, on) -> None:
    assert _worker._env_on(env) is on


def test_the_bootstrap_is_a_plain_dict() -> None:
    assert tm.check_bootstrap(None) is None
    given = {"enabled": True, "span_groups": "checkpoint"}  # unknown keys are accepted
    assert tm.check_bootstrap(given) == given
    with pytest.raises(ConfigurationError, match="must be a dict"):
        tm.check_bootstrap(["enabled"])
    with pytest.raises(ConfigurationError, match="resource_attrs"):
        tm.check_bootstrap({"resource_attrs": "job=1"})


def test_sdk_disabled_wins_over_the_bootstrap(monkeypatch) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert tm.setup_worker({"enabled": True, "endpoint": "http://127.0.0.1:9"}, 0) is False
    assert _worker._current is None


def test_a_save_without_opentelemetry_imports_none_of_it(tmp_path) -> None:
    # A fresh interpreter: the application never imported OpenTelemetry, so the library's
    # hooks must not import it either (not even the API) and record nothing.
    script = textwrap.dedent(
        """
        import sys
        import torch
        from resilient_ckpt.async_ckpt.torch_ckpt import TorchAsyncCheckpoint
        from resilient_ckpt._telemetry import _trainer

        ckpt = TorchAsyncCheckpoint()
        ckpt.async_save({"w": torch.ones(1000)}, "w.pt")
        ckpt.finalize_async_save(blocking=True)
        ckpt.close()
        loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
        assert not loaded, loaded
        assert not _trainer._open and _trainer._made is None
        assert torch.load("w.pt")["w"].sum() == 1000
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO)]))
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_suspended_saves_record_nothing() -> None:
    pytest.importorskip("opentelemetry.trace")

    class Caller:
        pass

    caller = Caller()
    with tm.suspended():
        assert tm.prepare_save("dcp") is None
        assert tm.begin_save(caller, 0) is None
        assert tm.traceparent(caller, 0) is None
        with tm.phase(caller, 0, tm.STAGE_SPAN), tm.finalizing(caller, 0):
            pass
        tm.end_save(caller, 0, {"stall": 0.1})
    assert caller not in _trainer._open
