"""The persistent worker never imports the trainer's main module at start-up (issue 34).

Each test runs a real trainer program (``python script.py`` or ``python -c``) in a fresh
directory, as a new user would, with this checkout's package on its path.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import resilient_ckpt
from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest

SRC = os.path.dirname(os.path.dirname(os.path.abspath(resilient_ckpt.__file__)))

# The README's first quickstart as a plain script: no `if __name__ == "__main__":` guard.
# The queue's request names a function of the user's own module beside the script.
_QUICKSTART = """
import os
import torch
from resilient_ckpt.async_ckpt import TorchAsyncCheckpoint
from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
import user_io

torch.manual_seed(0)
model = torch.nn.Linear(16, 4)
optim = torch.optim.SGD(model.parameters(), lr=0.1)
os.makedirs("ckpt", exist_ok=True)
ckpt = TorchAsyncCheckpoint()
for step in range(4):
    ckpt.finalize_async_save(blocking=False)
    optim.zero_grad()
    model(torch.randn(8, 16)).square().mean().backward()
    optim.step()
    if step % 2 == 1:
        ckpt.async_save(model.state_dict(), f"ckpt/step_{step}.pt")
ckpt.finalize_async_save(blocking=True, terminate=True)
torch.save(model.state_dict(), "expected.pt")

queue = AsyncCallsQueue(persistent=True)
queue.schedule_async_request(AsyncRequest(user_io.save, (model.state_dict(), "ckpt/queue.pt"), []))
assert queue.maybe_finalize_async_calls(blocking=True, no_dist=True) == [0]
queue.close()
print("done")
"""

_USER_IO = """
import torch

def save(state, path):
    torch.save(state, path)
"""

# A request whose function lives in the main module itself.
_MAIN_FUNCTION = """
import sys
import torch
from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from resilient_ckpt.errors import AsyncCallFailedError

def save_in_main(state, path):
    torch.save(state, path)

def run():
    queue = AsyncCallsQueue(persistent=True)
    queue.schedule_async_request(
        AsyncRequest(save_in_main, ({"w": torch.arange(6.0)}, "main_fn.pt"), [])
    )
    try:
        queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    except AsyncCallFailedError as exc:
        print("FAILED", type(exc).__name__, exc)
    else:
        print("SAVED", torch.load("main_fn.pt")["w"].tolist())
    queue.close()
"""


def _run(tmp_path: Path, args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.timeout(300)
def test_the_first_quickstart_works_as_a_python_c_program(tmp_path) -> None:
    # As an unguarded script file it is the README's first block, which
    # tests/dist/test_docs_examples.py runs as `python main.py`.
    (tmp_path / "user_io.py").write_text(_USER_IO)
    done = _run(tmp_path, ["-c", _QUICKSTART])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.split() == ["done"]
    expected = torch.load(tmp_path / "expected.pt")
    for name in ("step_3.pt", "queue.pt"):
        loaded = torch.load(tmp_path / "ckpt" / name)
        assert loaded.keys() == expected.keys()
        assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["queue.pt", "step_1.pt", "step_3.pt"]


@pytest.mark.timeout(300)
def test_a_main_function_of_a_python_c_program_fails_naming_it(tmp_path) -> None:
    done = _run(tmp_path, ["-c", _MAIN_FUNCTION + "\nrun()\n"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.startswith("FAILED"), done.stdout + done.stderr[-3000:]
    assert "WorkerDied" not in done.stdout
    assert "MainModuleError" in done.stdout
    assert "__main__.save_in_main" in done.stdout
    assert "`python -c` program" in done.stdout
    assert "move save_in_main into an importable module" in done.stdout
    assert not (tmp_path / "main_fn.pt").exists()


@pytest.mark.timeout(300)
def test_a_main_function_of_a_guarded_script_is_imported_on_demand(tmp_path) -> None:
    (tmp_path / "train.py").write_text(_MAIN_FUNCTION + '\nif __name__ == "__main__":\n    run()\n')
    done = _run(tmp_path, ["train.py"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.split("\n")[0] == "SAVED [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]", done.stderr


@pytest.mark.timeout(300)
def test_a_main_function_of_an_unguarded_script_fails_with_the_guard_advice(tmp_path) -> None:
    """Importing the script in the worker would start its training there: it stops at the
    worker's first save, and the request's error says to guard the entry point."""
    (tmp_path / "train.py").write_text(_MAIN_FUNCTION + "\nrun()\n")
    done = _run(tmp_path, ["train.py"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.startswith("FAILED"), done.stdout + done.stderr[-3000:]
    assert "MainModuleError" in done.stdout and "__main__.save_in_main" in done.stdout
    assert "train.py" in done.stdout
    assert "cannot start a checkpoint worker of its own" in done.stdout
    assert "Guard the script's entry point" in done.stdout


_PROBE = """
import multiprocessing
import sys

def report(results):
    process = multiprocessing.current_process()
    results.put((sys.argv, process.name, process.daemon))
"""


@pytest.mark.timeout(180)
def test_the_worker_has_the_trainers_path_argv_and_authkey(tmp_path, monkeypatch) -> None:
    """What spawn gave the worker, it still has: a module found only through a path the
    trainer added at run time imports there, it sees the trainer's argv, and a
    multiprocessing manager's proxy in a request connects (it needs the trainer's key)."""
    (tmp_path / "rc_worker_probe.py").write_text(_PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["trainer.py", "--probe"])
    import rc_worker_probe

    manager = multiprocessing.get_context("spawn").Manager()
    queue = AsyncCallsQueue(persistent=True, is_daemon=True)
    try:
        results = manager.Queue()
        queue.schedule_async_request(AsyncRequest(rc_worker_probe.report, (results,), []))
        assert queue.maybe_finalize_async_calls(blocking=True, no_dist=True) == [0]
        argv, name, daemon = results.get(timeout=30)
    finally:
        queue.close()
        manager.shutdown()
    assert argv == ["trainer.py", "--probe"]
    assert name == "resilient_ckpt-worker-0" and daemon is True
