"""The start-up hook from a regular wheel (``pip install .``), not only the editable install.

``make venv`` installs the package editable, where ``setup.py`` adds the ``.pth`` hook to the
editable wheel; a user's ``pip install`` gets it from ``build_py`` instead. This builds the
wheel from a copy of the sources, installs it into a fresh environment (torch comes from this
one through a path file, nothing is downloaded), and checks the switch there, and that
uninstalling removes the hook.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from resilient_ckpt.config import NVRX_ALIAS_ENV

REPO = Path(__file__).resolve().parents[2]
HOOK = "resilient_ckpt_nvrx_alias.pth"


def _run(*cmd: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=150)
    assert done.returncode == 0, f"{cmd}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.timeout(180)
def test_wheel_install_ships_the_start_up_hook(tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip"]
    _run(*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(source))
    (wheel,) = tmp_path.glob("resilient_ckpt-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert HOOK in archive.namelist()  # at the root: installed into site-packages

    env_dir = tmp_path / "env"
    _run(sys.executable, "-m", "venv", "--without-pip", str(env_dir))
    python = str(env_dir / "bin" / "python")
    _run(*pip, "--python", python, "install", "-q", "--no-deps", "--no-index", str(wheel))
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"))
    site = Path(str(site).strip())
    assert (site / HOOK).is_file()
    # torch and the other requirements from this environment, after the new site-packages
    (site / "_deps_from_test.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env[NVRX_ALIAS_ENV] = "1"
    probe = (
        "import nvidia_resiliency_ext.checkpointing.async_ckpt.core as theirs\n"
        "import resilient_ckpt.async_ckpt.core as ours\n"
        "print(theirs is ours, ours.__file__)\n"
    )
    same, path = _run(python, "-c", probe, env=env).split()
    assert same == "True" and path.startswith(str(site)), path

    _run(*pip, "--python", python, "uninstall", "-q", "-y", "resilient-ckpt")
    assert not (site / HOOK).exists()
