"""A SIGKILLed trainer leaves no worker process and no shared-memory segment behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests import _helpers

pytestmark = pytest.mark.fault

_TRAINER = """
import sys, time, torch
from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from tests import _helpers

if __name__ == "__main__":
    out, marker = sys.argv[1], sys.argv[2]
    queue = AsyncCallsQueue(persistent={persistent})
    state = {{"w": torch.randn(1 << 20)}}
    queue.schedule_async_request(
        AsyncRequest(_helpers.write_after_marker, (out, state, marker, 120), []))
    print("scheduled", flush=True)
    time.sleep(300)
"""


@pytest.mark.parametrize("persistent", [True, False])
def test_killed_trainer_leaves_no_worker_and_no_shm(tmp_path, persistent) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(_TRAINER.format(persistent=persistent))
    marker = tmp_path / "worker_pid"
    before = _helpers.shm_segments()
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    trainer = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "x.pt"), str(marker)],
        env=env,
        stdout=subprocess.PIPE,
    )
    try:
        worker_pid = int(_helpers.wait_for_file(str(marker), timeout=90))
        assert _helpers.pid_alive(worker_pid)
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(10)
        deadline = time.monotonic() + 10
        while _helpers.pid_alive(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _helpers.pid_alive(worker_pid), "worker outlived its trainer by 10 s"
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    assert _helpers.shm_segments() - before == set()
    assert not (tmp_path / "x.pt").exists()
