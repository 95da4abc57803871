"""The trainer's main module in the checkpoint worker: described by the trainer, imported
by the worker only when a request names one of its functions or classes.

Decision: the worker (:mod:`._worker`) does not import the trainer's main module when it
starts. ``multiprocessing``'s ``spawn`` does: it runs the main script again under the name
``__mp_main__``, so a script without an ``if __name__ == "__main__":`` guard runs its
training a second time inside the worker, which dies (NVRx and ``dcp.async_save`` share the
trap). Most requests never need that module: ``torch.save``, the DCP writer and the local
checkpoints are the library's functions, and a user's own functions usually live in
importable modules. A plain script, ``python -c`` and a notebook cell therefore all work.

A request that does name a function or class of ``__main__`` gets it as spawn would have
given it, but only then: the unpickler of :func:`._staging.unstage`
(:class:`MainAwareUnpickler`) asks :func:`find_in_main`, which imports the main module once,
as the trainer described it at start (:func:`describe_main`: its import name when run with
``python -m``, else its file), under the name ``__mp_main__`` (so its guarded block does not
run), and installs it as ``__main__`` and ``__mp_main__``. A trainer that was itself started
by spawn pickles its main module's functions as ``__mp_main__.<name>``: the same module.

When that cannot work the request fails with :class:`~resilient_ckpt.errors.MainModuleError`
naming the function and what to do:

* the main module has no file to import (``python -c``, a notebook, an interactive
  session), or it is a package's ``__main__`` (``python -m pkg``), which spawn does not run
  again either: it is the program itself;
* importing it failed (an unguarded script that starts checkpointing when imported fails
  this way, see :func:`._worker.in_worker`). The failure is kept: the script is not run a second
  time for the next request;
* it imported, but has no such name at module level (defined under the guard).

A module of its own, below staging: staging's unpickler needs it, and the worker's main
loop, which sets the description, imports staging.
"""

from __future__ import annotations

import os
import pickle
import runpy
import sys
import types
from dataclasses import dataclass
from typing import Any

from ..errors import MainModuleError

_MAIN_NAMES = frozenset({"__main__", "__mp_main__"})


@dataclass(frozen=True)
class MainModule:
    """The trainer's main module: its import name (``python -m pkg.mod``), its file
    (``python script.py``), or neither (``python -c``, a notebook).
    """

    name: str | None = None
    path: str | None = None

    def source(self) -> str:
        if self.name is not None:
            return f"module {self.name}"
        return f"script {self.path}"


def describe_main() -> MainModule:
    """Trainer side: this process's main module, as spawn would record it."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if isinstance(name, str):
        return MainModule(name=name)
    path = getattr(main, "__file__", None)
    if isinstance(path, str):
        return MainModule(path=os.path.abspath(path))
    return MainModule()


# Worker side: what the trainer described, and the outcome of importing it (once).
_described: MainModule | None = None
_module: types.ModuleType | None = None
_import_error: BaseException | None = None


def set_main_description(main: MainModule) -> None:
    """Worker side, at start-up: the trainer's main module, imported by :func:`find_in_main`."""
    global _described
    _described = main


def find_in_main(qualname: str) -> Any:
    """Worker side: the trainer's ``__main__.<qualname>``, importing its main module on first use;
    :class:`MainModuleError` naming it when that cannot work.
    """
    main = _described or MainModule()
    module = _import_once(main, qualname)
    obj: Any = module
    try:
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except AttributeError as exc:
        raise _error(
            qualname,
            f"the trainer's main {main.source()}, imported (as __mp_main__, so its `if "
            f"__name__ == '__main__':` block did not run), defines no {qualname} at module "
            "level. Define it at module level, or",
        ) from exc
    return obj


def _import_once(main: MainModule, qualname: str) -> types.ModuleType:
    global _module, _import_error
    if _module is not None:
        return _module
    if main.path is None and (main.name is None or _is_package_main(main.name)):
        raise _error(qualname, _unavailable(main))
    if _import_error is None:
        try:
            _module = _run_main(main)
            return _module
        except BaseException as exc:  # SystemExit too: a script's argument parsing
            _import_error = exc
    raise _error(
        qualname,
        f"importing the trainer's main {main.source()} (as __mp_main__) failed with "
        f"{type(_import_error).__name__}: {_import_error}. Guard the script's entry point "
        "with `if __name__ == '__main__':`, so that importing it only defines things, or",
    ) from _import_error


def _is_package_main(name: str) -> bool:
    return name == "__main__" or name.endswith(".__main__")


def _unavailable(main: MainModule) -> str:
    if main.name is not None:
        return (
            f"the trainer's main module is the package entry point {main.name}, which is the "
            "program itself and is not imported again. Instead,"
        )
    return (
        "the trainer's main module has no file to import (a `python -c` program, an "
        "interactive session or a notebook). Instead,"
    )


def _error(qualname: str, why: str) -> MainModuleError:
    return MainModuleError(
        f"the async request refers to __main__.{qualname}, which the checkpoint worker "
        f"cannot import: {why} move {qualname} into an importable module (a .py file on "
        "sys.path) and import it from there",
        qualname=qualname,
    )


def _run_main(main: MainModule) -> types.ModuleType:
    """Import the main module as spawn does: run it under the name ``__mp_main__``."""
    if main.name is not None:
        namespace = runpy.run_module(main.name, run_name="__mp_main__", alter_sys=True)
    else:
        namespace = runpy.run_path(str(main.path), run_name="__mp_main__")
    module = types.ModuleType("__mp_main__")
    module.__dict__.update(namespace)
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module
    return module


class MainAwareUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that finds the trainer's ``__main__`` names through :func:`find_in_main`
    (in a worker; elsewhere the plain unpickler).
    """

    def find_class(self, module: str, name: str) -> Any:
        if module in _MAIN_NAMES and _described is not None:
            return find_in_main(name)
        return super().find_class(module, name)
