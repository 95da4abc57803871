"""Run code that imports ``nvidia_resiliency_ext.checkpointing`` on this package, unchanged.

Megatron-LM, NeMo and other NVRx clients import NVRx by name; their users cannot edit those
imports. :func:`install_nvrx_alias` (or ``RESILIENT_CKPT_NVRX_ALIAS=1``) makes
``import nvidia_resiliency_ext.checkpointing.<path>`` return the module
``resilient_ckpt.<path>`` itself, for every module of the package. Opt-in: nothing is aliased
unless asked for.

* **The same module objects, not copies.** A meta-path finder placed first hands the import
  system the already imported ``resilient_ckpt`` module, lazily, so both names share classes,
  globals (``filesystem_async._results_queue``) and ``isinstance``; loading the files again
  under the other name (a ``sys.path`` trick) would split that state. The import system
  overwrites the returned module's ``__spec__``; the loader puts its own back so
  ``importlib.reload`` and pickling by module name keep working.
* **Only the checkpointing part.** ``nvidia_resiliency_ext`` is a small synthetic package;
  probes for other NVRx subpackages (``fault_tolerance`` ...) fail as they do without NVRx.
  It is located at ours (``__file__``, ``__path__``, spec origin) for tools that report where
  a module came from; since that ``__path__`` would let the path finder load our modules again
  as ``nvidia_resiliency_ext.<name>``, the finder refuses those names.
* **A version clients accept.** Megatron-core requires ``__version__ >= 0.6.0``: the alias
  reports :data:`NVRX_API_VERSION` and marks itself with ``__resilient_ckpt_version__``.
* **Refuse next to the real NVRx**, imported or importable (:class:`NvrxAliasError`): with two
  packages answering one name, path order would pick the one a job uses.
* **Children inherit it.** ``torchrun`` workers and ``spawn``-ed processes are fresh
  interpreters: the distribution ships ``resilient_ckpt_nvrx_alias.pth``, which runs
  :func:`install_nvrx_alias_from_environment` at start-up when the variable is set, and
  :func:`install_nvrx_alias` sets it by default. The hook never fails start-up: a problem is
  one line on stderr and no alias.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import threading
import types
from collections.abc import Sequence

from . import __version__ as _our_version
from .config import nvrx_alias_requested, request_nvrx_alias_in_children
from .errors import ConfigurationError

__all__ = [
    "NVRX_API_VERSION",
    "NvrxAliasError",
    "install_nvrx_alias",
    "install_nvrx_alias_from_environment",
    "nvrx_alias_installed",
    "uninstall_nvrx_alias",
]

logger = logging.getLogger(__name__)

NVRX_TOP = "nvidia_resiliency_ext"
NVRX_CHECKPOINTING = NVRX_TOP + ".checkpointing"
OUR_TOP = __name__.rpartition(".")[0]

NVRX_API_VERSION = "0.7.0"
"""The NVRx release whose checkpointing API this package implements (the alias's version)."""

_lock = threading.Lock()
_startup_error_reported = False


class NvrxAliasError(ConfigurationError):
    """The ``nvidia_resiliency_ext`` alias cannot be installed (the real NVRx is present)."""


def _our_name(nvrx_name: str) -> str | None:
    """``resilient_ckpt.<path>`` for ``nvidia_resiliency_ext.checkpointing.<path>``."""
    if nvrx_name == NVRX_CHECKPOINTING:
        return OUR_TOP
    if nvrx_name.startswith(NVRX_CHECKPOINTING + "."):
        return OUR_TOP + nvrx_name[len(NVRX_CHECKPOINTING) :]
    return None


class _NvrxAliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finder and loader of the ``nvidia_resiliency_ext`` names (see the module docstring)."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == NVRX_TOP:
            return _top_spec(self)
        ours = _our_name(fullname)
        if ours is None:
            _refuse_our_modules_under_the_top(fullname)
            return None
        our_spec = importlib.util.find_spec(ours)
        if our_spec is None:
            return None
        is_package = our_spec.submodule_search_locations is not None
        spec = importlib.machinery.ModuleSpec(fullname, self, is_package=is_package)
        spec.loader_state = ours
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        if spec.name == NVRX_TOP:
            return None  # the import system creates an empty package; exec_module fills it
        ours = importlib.import_module(spec.loader_state)
        spec.loader_state = ours.__spec__  # kept for exec_module, see there
        return ours

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__name__ == NVRX_TOP:
            _fill_top_package(module)
            return
        # Between create_module and here the import system set __spec__ of our module to
        # the alias spec; put its own spec back.
        alias_spec = module.__spec__
        if alias_spec is not None and alias_spec.loader is self:
            module.__spec__ = alias_spec.loader_state


def _top_spec(loader: _NvrxAliasFinder) -> importlib.machinery.ModuleSpec:
    """The synthetic package's spec, located at our package (``__file__``, ``__path__``)."""
    ours = sys.modules[OUR_TOP]
    spec = importlib.machinery.ModuleSpec(NVRX_TOP, loader, origin=ours.__file__, is_package=True)
    spec.submodule_search_locations = list(ours.__path__)
    spec.has_location = True
    return spec


def _refuse_our_modules_under_the_top(fullname: str) -> None:
    """Refuse ``nvidia_resiliency_ext.<name>`` where ``<name>`` is one of our modules (the
    top's ``__path__`` would load a second copy); other names stay ordinary misses."""
    parent, _, child = fullname.rpartition(".")
    if parent != NVRX_TOP or importlib.util.find_spec(f"{OUR_TOP}.{child}") is None:
        return
    raise ModuleNotFoundError(
        f"No module named {fullname!r}: the {NVRX_TOP} alias provides only {NVRX_CHECKPOINTING}",
        name=fullname,
    )


def _fill_top_package(module: types.ModuleType) -> None:
    module.__doc__ = f"Alias installed by resilient_ckpt.compat: {NVRX_CHECKPOINTING} is {OUR_TOP}."
    module.__version__ = NVRX_API_VERSION  # type: ignore[attr-defined]
    module.__resilient_ckpt_version__ = _our_version  # type: ignore[attr-defined]
    module.__resilient_ckpt_alias__ = True  # type: ignore[attr-defined]


def _installed_finder() -> _NvrxAliasFinder | None:
    return next((f for f in sys.meta_path if isinstance(f, _NvrxAliasFinder)), None)


def nvrx_alias_installed() -> bool:
    """Whether ``nvidia_resiliency_ext.checkpointing`` currently resolves to this package."""
    return _installed_finder() is not None


def _real_nvrx_location() -> str | None:
    """Where a real ``nvidia_resiliency_ext`` is (imported or importable); None if nowhere."""
    loaded = sys.modules.get(NVRX_TOP)
    if loaded is not None and not getattr(loaded, "__resilient_ckpt_alias__", False):
        return str(getattr(loaded, "__file__", None) or loaded)
    for finder in sys.meta_path:
        if isinstance(finder, _NvrxAliasFinder):
            continue
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        spec = find_spec(NVRX_TOP, None)
        if spec is not None:
            return str(spec.origin or list(spec.submodule_search_locations or ()))
    return None


def install_nvrx_alias(*, propagate: bool = True) -> None:
    """Make ``nvidia_resiliency_ext.checkpointing.*`` imports resolve to ``resilient_ckpt``.

    Call it before the first import of the client (Megatron-core probes NVRx when
    ``megatron.core.dist_checkpointing`` is imported). Idempotent.

    Args:
        propagate: also set ``RESILIENT_CKPT_NVRX_ALIAS=1`` in ``os.environ``, so that
            interpreters started from this process (``torchrun`` workers, ``spawn``-ed
            processes) alias as well.

    Raises:
        NvrxAliasError: the real ``nvidia_resiliency_ext`` is installed or imported.
    """
    with _lock:
        if _installed_finder() is None:
            location = _real_nvrx_location()
            if location is not None:
                raise NvrxAliasError(
                    f"cannot alias {NVRX_TOP} to {OUR_TOP}: the real {NVRX_TOP} is installed "
                    f"({location}). Use one of them: uninstall nvidia-resiliency-ext "
                    f"(pip uninstall nvidia-resiliency-ext), or do not ask for the alias "
                    f"(unset RESILIENT_CKPT_NVRX_ALIAS)"
                )
            sys.meta_path.insert(0, _NvrxAliasFinder())
            logger.debug("%s now resolves to %s", NVRX_CHECKPOINTING, OUR_TOP)
    if propagate:
        request_nvrx_alias_in_children()


def uninstall_nvrx_alias() -> None:
    """Remove the alias and forget the ``nvidia_resiliency_ext`` module names it created.

    The ``resilient_ckpt`` modules stay imported; ``RESILIENT_CKPT_NVRX_ALIAS`` is left as is.
    """
    with _lock:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _NvrxAliasFinder)]
        top = sys.modules.get(NVRX_TOP)
        if top is None or not getattr(top, "__resilient_ckpt_alias__", False):
            return
        for name in [n for n in sys.modules if n == NVRX_TOP or n.startswith(NVRX_TOP + ".")]:
            del sys.modules[name]


def install_nvrx_alias_from_environment() -> bool:
    """The start-up hook: install the alias if ``RESILIENT_CKPT_NVRX_ALIAS`` asks for it.

    Never raises: it runs while Python starts, for every program of the environment. A wrong
    value or a real NVRx is reported on stderr and leaves the alias out. Returns whether the
    alias is installed.
    """
    global _startup_error_reported
    try:
        if nvrx_alias_requested():
            install_nvrx_alias(propagate=False)
    except ConfigurationError as exc:
        # site.py may run the hook twice (venvs list lib64 -> lib as a second site dir).
        if not _startup_error_reported:
            print(f"resilient_ckpt: no {NVRX_TOP} alias: {exc}", file=sys.stderr)
            _startup_error_reported = True
    return nvrx_alias_installed()
