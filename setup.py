"""Build hooks (metadata lives in pyproject.toml): ship the NVRx alias start-up hook.

``resilient_ckpt_nvrx_alias.pth`` must land in ``site-packages`` itself, the only place where
Python runs ``.pth`` files at start-up; setuptools' declarative options can put files only
inside packages or under the installation prefix. So the regular wheel gets it from
``build_py`` (everything in ``build_lib`` goes to the wheel's root), and the editable wheel
(``pip install -e``, as ``make venv`` does), which does not copy ``build_lib``, gets it from
``editable_wheel`` next to its own ``__editable__`` file. What the line does: see
``resilient_ckpt/compat.py``.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH_NAME = "resilient_ckpt_nvrx_alias.pth"
# One line, run by site.py for every interpreter of the environment: it must cost nothing
# unless RESILIENT_CKPT_NVRX_ALIAS is set (resilient_ckpt.config parses the value).
PTH_LINE = (
    "import os; os.environ.get('RESILIENT_CKPT_NVRX_ALIAS') and "
    "__import__('resilient_ckpt.compat').compat.install_nvrx_alias_from_environment()\n"
)


def _write_pth(directory: str | Path) -> str:
    target = Path(directory, PTH_NAME)
    target.write_text(PTH_LINE, encoding="utf-8")
    return str(target)


class BuildPyWithAliasHook(build_py):
    def run(self) -> None:
        super().run()
        self._alias_hook = _write_pth(self.build_lib)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        hook = getattr(self, "_alias_hook", None)
        return super().get_outputs(include_bytecode) + ([hook] if hook else [])


class EditableWheelWithAliasHook(editable_wheel):
    def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):  # type: ignore[no-untyped-def]
        result = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
        _write_pth(unpacked_wheel)  # the editable wheel's root is site-packages
        return result


setup(cmdclass={"build_py": BuildPyWithAliasHook, "editable_wheel": EditableWheelWithAliasHook})
