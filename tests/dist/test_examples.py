"""examples/async_dcp.py (the async DCP guide points to it) runs as its docstring says, and
its checkpoints verify."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from resilient_ckpt.cli import main as cli_main

pytestmark = pytest.mark.dist

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")


@pytest.mark.timeout(180)
def test_async_dcp_example(tmp_path, capsys) -> None:
    root = str(tmp_path / "dcp_example")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [os.path.join(EXAMPLES, "async_dcp.py"), root]
    done = subprocess.run(
        cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=150
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "saved and reloaded" in done.stdout
    assert sorted(os.listdir(root)) == ["iter_0000005", "iter_0000010"]
    assert cli_main(["verify", root]) == 0
    assert "every byte checksummed" in capsys.readouterr().out
