"""Every runnable ```python block of the README and the docs runs as its page says.

Each block (see ``tests/_docs.py`` for the markers) is written to ``main.py`` in a fresh
directory and run in a fresh process, on the CPU: ``python main.py``, or for a block marked
as a ``torchrun`` script ``torchrun --standalone --nproc-per-node N main.py``. A block the
README repeats from a guide runs once. The blocks are kept small (a 256 x 256 model, a few
saves): what they show is the API at work, not speed.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests._docs import ROOT, Block, runnable

pytestmark = pytest.mark.dist


def _command(block: Block) -> list[str]:
    if block.nproc is None:
        return [sys.executable, "main.py"]
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*run, f"--nproc-per-node={block.nproc}", "main.py"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("block", runnable(), ids=lambda b: b.name)
def test_block_runs(block: Block, tmp_path) -> None:
    (tmp_path / "main.py").write_text(block.code)
    # This checkout's package, whatever is installed; one thread per process (2 cores).
    path = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    done = subprocess.run(
        _command(block), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200
    )
    assert done.returncode == 0, f"{block.name}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
