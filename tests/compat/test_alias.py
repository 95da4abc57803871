"""The opt-in ``nvidia_resiliency_ext`` alias: same module objects, refusal, start-up switch.

In-process checks install the alias without propagating it to the environment and remove it
again; the start-up switch (``RESILIENT_CKPT_NVRX_ALIAS`` read by the ``.pth`` hook) is checked
in fresh interpreters, several at once (each one imports torch).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.version import Version

from resilient_ckpt import compat
from resilient_ckpt.config import NVRX_ALIAS_ENV

# DESIGN.md section 1: every module of the contract, relative to the top package.
CONTRACT_MODULES = [
    "async_ckpt",
    "async_ckpt.core",
    "async_ckpt.torch_ckpt",
    "async_ckpt.filesystem_async",
    "async_ckpt.state_dict_saver",
    "async_ckpt.cached_metadata_filesystem_reader",
    "local",
    "local.base_state_dict",
    "local.basic_state_dict",
    "local.ckpt_managers",
    "local.ckpt_managers.base_manager",
    "local.ckpt_managers.local_manager",
    "local.replication",
    "local.replication.group_utils",
    "local.replication.strategies",
    "utils",
]


@pytest.fixture
def alias(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(NVRX_ALIAS_ENV, raising=False)
    compat.install_nvrx_alias(propagate=False)
    try:
        yield
    finally:
        compat.uninstall_nvrx_alias()


def test_every_contract_module_is_the_same_object(alias: None) -> None:
    for rel in CONTRACT_MODULES:
        theirs = importlib.import_module(f"nvidia_resiliency_ext.checkpointing.{rel}")
        ours = importlib.import_module(f"resilient_ckpt.{rel}")
        assert theirs is ours, rel
        assert ours.__spec__ is not None and ours.__spec__.name == f"resilient_ckpt.{rel}"
        assert ours.__name__ == f"resilient_ckpt.{rel}"
    import nvidia_resiliency_ext.checkpointing as checkpointing

    import resilient_ckpt

    assert checkpointing is resilient_ckpt
    # Megatron's probes: names, the module-global results queue, the version floor.
    from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue

    assert AsyncCallsQueue is resilient_ckpt.AsyncCallsQueue
    assert hasattr(filesystem_async, "_results_queue")
    nvrx = sys.modules["nvidia_resiliency_ext"]
    assert Version(nvrx.__version__) >= Version("0.6.0")
    assert nvrx.__resilient_ckpt_version__ == resilient_ckpt.__version__


def test_alias_answers_only_for_what_exists(alias: None) -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("nvidia_resiliency_ext.fault_tolerance")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("nvidia_resiliency_ext.checkpointing.async_ckpt.no_such_module")
    core = importlib.import_module("nvidia_resiliency_ext.checkpointing.async_ckpt.core")
    assert importlib.reload(core) is core  # our own spec is back in place


def test_top_package_is_located_at_ours(alias: None) -> None:
    import resilient_ckpt

    nvrx = importlib.import_module("nvidia_resiliency_ext")
    assert nvrx.__file__ == resilient_ckpt.__file__
    assert inspect.getfile(nvrx) == resilient_ckpt.__file__
    assert nvrx.__path__ == list(resilient_ckpt.__path__)
    assert os.path.dirname(nvrx.__file__) == nvrx.__path__[0]
    spec = nvrx.__spec__
    assert spec is not None and spec.name == "nvidia_resiliency_ext"
    assert spec.origin == resilient_ckpt.__file__ and spec.has_location
    assert spec.submodule_search_locations == nvrx.__path__
    # Still the alias (not a second import of our package) after a reload.
    assert importlib.reload(nvrx) is nvrx and nvrx.__resilient_ckpt_alias__
    assert nvrx.__file__ == resilient_ckpt.__file__


def test_top_package_path_does_not_import_our_modules_twice(alias: None) -> None:
    import resilient_ckpt.utils

    # `utils` is in the top package's __path__ (our directory), but is not an NVRx name.
    with pytest.raises(ModuleNotFoundError, match="provides only") as info:
        importlib.import_module("nvidia_resiliency_ext.utils")
    assert info.value.name == "nvidia_resiliency_ext.utils"
    assert "nvidia_resiliency_ext.utils" not in sys.modules
    assert importlib.import_module("nvidia_resiliency_ext.checkpointing.utils") is (
        resilient_ckpt.utils
    )
    # A probe for an NVRx subpackage that is not provided stays an ordinary miss.
    assert importlib.util.find_spec("nvidia_resiliency_ext.fault_tolerance") is None


def test_install_is_idempotent_and_uninstall_forgets_the_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(NVRX_ALIAS_ENV, raising=False)
    try:
        compat.install_nvrx_alias(propagate=False)
        compat.install_nvrx_alias(propagate=False)
        finders = [f for f in sys.meta_path if type(f).__name__ == "_NvrxAliasFinder"]
        assert len(finders) == 1 and sys.meta_path[0] is finders[0]
        importlib.import_module("nvidia_resiliency_ext.checkpointing.utils")
        assert NVRX_ALIAS_ENV not in os.environ
    finally:
        compat.uninstall_nvrx_alias()
    assert not compat.nvrx_alias_installed()
    assert not any(name.startswith("nvidia_resiliency_ext") for name in sys.modules)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("nvidia_resiliency_ext")


def test_install_propagates_to_children_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NVRX_ALIAS_ENV, raising=False)
    try:
        compat.install_nvrx_alias()
        assert os.environ[NVRX_ALIAS_ENV] == "1"
    finally:
        compat.uninstall_nvrx_alias()


def _fake_real_nvrx(root: Path) -> Path:
    package = root / "nvidia_resiliency_ext"
    package.mkdir()
    (package / "__init__.py").write_text("__version__ = '0.6.0'\nREAL = True\n")
    return root


def test_refuses_when_the_real_nvrx_is_importable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(_fake_real_nvrx(tmp_path)))
    with pytest.raises(compat.NvrxAliasError, match="real nvidia_resiliency_ext is installed") as e:
        compat.install_nvrx_alias(propagate=False)
    assert str(tmp_path) in str(e.value) and "pip uninstall" in str(e.value)
    assert not compat.nvrx_alias_installed()


def test_refuses_when_the_real_nvrx_is_already_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nvidia_resiliency_ext", types.ModuleType("x"))
    with pytest.raises(compat.NvrxAliasError):
        compat.install_nvrx_alias(propagate=False)
    assert not compat.nvrx_alias_installed()


def test_bad_switch_value_is_a_configuration_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NVRX_ALIAS_ENV, "perhaps")
    from resilient_ckpt.config import nvrx_alias_requested
    from resilient_ckpt.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=NVRX_ALIAS_ENV):
        nvrx_alias_requested()


# --- the start-up switch, in fresh interpreters --------------------------------------------

_PROBE = textwrap.dedent(
    """
    import sys
    print("preloaded", "resilient_ckpt" in sys.modules)
    try:
        import nvidia_resiliency_ext as nvrx
    except ModuleNotFoundError:
        print("nvrx none")
    else:
        if getattr(nvrx, "REAL", False):
            print("nvrx real")
        else:
            import nvidia_resiliency_ext.checkpointing.async_ckpt.core as theirs
            import resilient_ckpt.async_ckpt.core as ours
            print("nvrx alias", theirs is ours, nvrx.__version__)
    """
)


def _start(env_value: str | None, pythonpath: str | None = None) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in (NVRX_ALIAS_ENV, "PYTHONPATH")}
    if env_value is not None:
        env[NVRX_ALIAS_ENV] = env_value
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return subprocess.Popen(
        [sys.executable, "-c", _PROBE],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
    )


@pytest.mark.timeout(120)
def test_environment_switch_at_interpreter_start(tmp_path: Path) -> None:
    fake = str(_fake_real_nvrx(tmp_path))
    runs = {
        "on": _start("1"),
        "unset": _start(None),
        "off": _start("0"),
        "bad": _start("perhaps"),
        "real": _start("1", pythonpath=fake),
    }
    out = {}
    for name, proc in runs.items():
        stdout, stderr = proc.communicate(timeout=100)
        assert proc.returncode == 0, (name, stderr)
        out[name] = (stdout.split("\n"), stderr)
    assert out["on"][0][:2] == ["preloaded True", "nvrx alias True 0.7.0"], out["on"]
    # Without the switch the hook costs nothing: the package is not even imported.
    assert out["unset"][0][:2] == ["preloaded False", "nvrx none"], out["unset"]
    assert out["off"][0][1] == "nvrx none", out["off"]
    assert out["bad"][0][1] == "nvrx none"
    assert f"{NVRX_ALIAS_ENV}='perhaps' is not a switch" in out["bad"][1]
    assert out["bad"][1].count("resilient_ckpt: no nvidia_resiliency_ext alias") == 1
    assert out["real"][0][1] == "nvrx real"
    assert "the real nvidia_resiliency_ext is installed" in out["real"][1]
    assert fake in out["real"][1]
