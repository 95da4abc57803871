"""``resilient-ckpt bench`` runs from an installed wheel, outside any checkout.

The wheel is built from this source tree and installed (without dependencies) into a fresh
virtual environment in a temporary directory; the dependencies (torch, numpy, ...) come from
the running environment through a ``.pth`` line, so nothing is downloaded. The command then
runs the DCP load benchmark with tiny sizes from the temporary directory.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

# Building a wheel and a virtual environment takes 30-90 s on the 2-core test machine, over
# the suite's budget for it: run it on purpose (CONTRIBUTING.md, "Tests"). The bench command
# itself is exercised on every run by tests/dist/test_cli.py (from the editable install).
pytestmark = [
    pytest.mark.dist,
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("RESILIENT_CKPT_TEST_INSTALL") != "1",
        reason="set RESILIENT_CKPT_TEST_INSTALL=1 to build and install a wheel",
    ),
]

ROOT = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], cwd: Path, timeout: float) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"{cmd}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.timeout(300)
def test_bench_runs_from_an_installed_wheel(tmp_path) -> None:
    wheels = tmp_path / "wheels"
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    _run([*build, "-q", "-w", str(wheels), str(ROOT)], tmp_path, 240)
    (wheel,) = wheels.glob("resilient_ckpt-*.whl")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, 120)
    python = venv / "bin" / "python"
    purelib = _run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp_path, 60
    ).strip()
    # Install with this environment's pip into the new one, then point it at our deps.
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps"]
    _run([*pip, str(wheel)], tmp_path, 120)
    deps = [p for p in site.getsitepackages() if "site-packages" in p]
    Path(purelib, "_deps.pth").write_text("\n".join(deps) + "\n")
    where = _run(
        [str(python), "-c", "import resilient_ckpt; print(resilient_ckpt.__file__)"], tmp_path, 60
    )
    assert where.startswith(str(venv)), where  # the installed copy, not the checkout
    work = tmp_path / "work"
    work.mkdir()
    command = str(venv / "bin" / "resilient-ckpt")
    args = ["bench", "--only", "dcp_load", "--dir", str(work), "--", "--size", "1M"]
    out = _run([command, *args, "--repeats", "1", "--tensors", "4"], tmp_path, 240)
    assert "CachedMetadataFileSystemReader" in out and "raw read" in out
    assert os.listdir(work) == []
