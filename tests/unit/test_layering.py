"""The layers of ``src/resilient_ckpt`` (CONTRIBUTING.md): a module imports only its own
layer or layers below it, and the library never imports its faces or the test kit.

The check reads every module's imports from its syntax tree (``import x``, ``from . import
y``, imports inside functions and under ``TYPE_CHECKING`` alike), so a lazy import that
breaks a layer fails here as surely as one at the top of a file.

Inside a layer, imports flow one way too: no two modules import each other, directly or
around a loop (issue 46). An import inside a function counts (it is an import hidden from
the reader, not a broken dependency); one under ``if TYPE_CHECKING:`` does not, since it
never runs. A package ``__init__`` that re-exports from a submodule depends on it like any
other importer, so a submodule must not import its own package's ``__init__`` back.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "resilient_ckpt"

# Bottom up. Faces and the test kit sit side by side at the top; a face may use the kit
# (a shipped utility), the kit never imports a face.
BASE, STORAGE, ASYNC, LOCAL, TIERED, FACES, TESTING = (
    "base",
    "storage",
    "async core",
    "local",
    "tiered",
    "faces",
    "testing",
)
RANK = {BASE: 0, STORAGE: 1, ASYNC: 2, LOCAL: 3, TIERED: 4, FACES: 5, TESTING: 5}
LAYER_OF = {
    "errors": BASE,
    "_exceptions": BASE,
    "_rank_errors": BASE,
    "config": BASE,
    "_logging": BASE,
    "_dist": BASE,
    "_rank": BASE,
    "_checksum": BASE,
    "_torch_compat": BASE,
    "_restricted_pickle": BASE,
    "_unpicklable": BASE,
    "_telemetry": BASE,
    "utils": BASE,
    "storage": STORAGE,
    "async_ckpt": ASYNC,
    # The package root re-exports the async core's public names: importing it is
    # importing the async core.
    "": ASYNC,
    "local": LOCAL,
    "tiered": TIERED,
    "cli": FACES,
    "integrations": FACES,
    "demo": FACES,
    # The NVRx import alias (issue 12): a face, it hands out every module by another name.
    "compat": FACES,
    # PyTorch-native face (issue 48): torch's dcp.async_save / AsyncStager / StorageWriter
    # protocols on the async core's public API.
    "dcp": FACES,
    "testing": TESTING,
}


def layer(module: str) -> str:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else ""
    if top.endswith("__main__"):
        top = ""
    if top not in LAYER_OF:
        raise AssertionError(
            f"{module} is in no layer: add {top!r} to LAYER_OF in {__file__} and to the "
            "layer table of CONTRIBUTING.md"
        )
    return LAYER_OF[top]


# The benchmarks behind ``resilient-ckpt bench`` spawn their ranks with the test kit's
# launcher (deadlines, rank failures reported): the one place a face uses the test kit.
BENCHMARKS = ("resilient_ckpt.cli.bench", "resilient_ckpt.cli.bench_stall")
LAUNCHER = ("resilient_ckpt.testing", "resilient_ckpt.testing.launcher")


def allowed(importer: str, imported: str) -> bool:
    src, dst = layer(importer), layer(imported)
    if (src, dst) == (TESTING, FACES):
        return False  # the test kit serves the library's users, not its command line
    if (src, dst) == (FACES, TESTING):
        return True  # e.g. the CLI's benchmarks start ranks with the shipped launcher
    return RANK[dst] <= RANK[src]


def modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """Every module under ``root/PACKAGE``: dotted name -> (file, is_package)."""
    found = {}
    for path in (root / PACKAGE).rglob("*.py"):
        dotted = ".".join(path.relative_to(root).with_suffix("").parts)
        is_package = path.name == "__init__.py"
        found[dotted.removesuffix(".__init__") if is_package else dotted] = (path, is_package)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``typing.TYPE_CHECKING``."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _nodes(tree: ast.AST, type_checking: bool) -> Iterator[ast.AST]:
    """Every node of ``tree``; without the bodies of ``if TYPE_CHECKING:`` unless asked."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if not type_checking and isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def imports(
    name: str,
    path: Path,
    is_package: bool,
    known: dict[str, tuple[Path, bool]],
    type_checking: bool = True,
) -> Iterator[tuple[int, str]]:
    """``(line, module)`` for every import of a module of the package in ``path``; ``from
    package import name`` is an import of the submodule ``name`` where there is one."""
    package = name if is_package else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    for node in sorted(_nodes(tree, type_checking), key=lambda n: getattr(n, "lineno", 0)):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names if a.name.startswith(PACKAGE))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                submodule = f"{module}.{alias.name}"
                yield node.lineno, submodule if submodule in known else module


def violations(root: Path) -> list[str]:
    known = modules(root)
    found = []
    for name, (path, is_package) in sorted(known.items()):
        for line, imported in imports(name, path, is_package, known):
            if not allowed(name, imported):
                found.append(
                    f"{path.relative_to(root)}:{line}: {name} ({layer(name)}) imports "
                    f"{imported} ({layer(imported)})"
                )
    return found


def test_no_module_imports_a_layer_above_it() -> None:
    assert violations(SRC) == []


def _fake_package(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / PACKAGE / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.mark.parametrize(
    "rel, text, culprit",
    [
        ("storage/posix.py", "from ..async_ckpt import _files\n", "storage"),
        ("async_ckpt/saver.py", "def f():\n    from ..local import agree\n", "async core"),
        ("_dist.py", "from .storage import base\n", "base"),
        ("errors.py", "import resilient_ckpt.cli\n", "base"),
        ("local/manager.py", "from ..testing import launch\n", "local"),
        ("testing/launcher.py", "from ..cli import main\n", "testing"),
        ("storage/base.py", "from .. import utils, _dist, async_ckpt\n", "storage"),
    ],
)
def test_the_check_catches_each_forbidden_direction(tmp_path, rel, text, culprit) -> None:
    skeleton = {
        f"{p}/__init__.py": ""
        for p in ("storage", "async_ckpt", "local", "cli", "testing", "integrations")
    }
    skeleton.update({"utils.py": "", "_dist.py": ""})
    root = _fake_package(tmp_path, {"__init__.py": "", **skeleton, rel: text})
    found = violations(root)
    assert len(found) == 1 and f"({culprit}) imports" in found[0], found


def test_allowed_directions_pass(tmp_path) -> None:
    root = _fake_package(
        tmp_path,
        {
            "__init__.py": "from .async_ckpt import core\n",
            "errors.py": "",
            "_dist.py": "from . import errors\nfrom ._logging import get_logger\n",
            "storage/__init__.py": "from .. import errors\n",
            "async_ckpt/__init__.py": "from ..storage import base\nfrom .. import _dist\n",
            "local/__init__.py": "from ..async_ckpt import core\n",
            "cli/__init__.py": "from ..local import x\nfrom .. import demo\n",
            "testing/__init__.py": "from ..local import y\nimport resilient_ckpt\n",
        },
    )
    assert violations(root) == []


def test_async_core_and_workers_load_neither_local_nor_dcp() -> None:
    """What the static check cannot see: imports made at run time. The DCP saver must not
    load the local-checkpoint layer; the package and its worker must not load torch's DCP
    (about a second), which is why the agreement errors live in ``_rank_errors``."""
    code = (
        "import sys\n"
        "import resilient_ckpt, resilient_ckpt.errors, resilient_ckpt.async_ckpt._worker\n"
        "light = 'torch.distributed.checkpoint' not in sys.modules\n"
        "import resilient_ckpt.async_ckpt.state_dict_saver\n"
        "import resilient_ckpt.async_ckpt.filesystem_async\n"
        "local = sorted(m for m in sys.modules if m.startswith('resilient_ckpt.local'))\n"
        "print(light, local)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True []", done.stdout


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of ``graph`` with more than one module (or a module importing
    itself), each sorted, in the order of their first module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def cycles(root: Path) -> dict[frozenset[str], str]:
    """Each import cycle (its modules, less the package prefix) -> its modules and each
    import inside it at file:line."""
    known = modules(root)
    graph: dict[str, set[str]] = {name: set() for name in known}
    edges: dict[tuple[str, str], dict[str, None]] = {}
    for name, (path, is_package) in sorted(known.items()):
        for line, imported in imports(name, path, is_package, known, type_checking=False):
            if imported in known:
                graph[name].add(imported)
                where = f"{path.relative_to(root)}:{line}"
                edges.setdefault((name, imported), {})[where] = None
    found = {}
    for component in _strongly_connected(graph):
        inside = [
            f"{src} -> {dst} ({', '.join(where)})"
            for (src, dst), where in sorted(edges.items())
            if src in component and dst in component
        ]
        short = frozenset(m.removeprefix(f"{PACKAGE}.") for m in component)
        found[short] = f"cycle {' / '.join(component)}: " + "; ".join(inside)
    return found


def test_no_import_cycle() -> None:
    found = cycles(SRC)
    assert not found, "\n".join(found.values())


@pytest.mark.parametrize(
    "files, expected",
    [
        ({"a.py": "from . import b\n", "b.py": "from .a import X\n"}, ["a", "b"]),
        (
            {"a.py": "def f():\n    from . import b\n", "b.py": "import resilient_ckpt.a\n"},
            ["a", "b"],
        ),
        (
            {
                "p/__init__.py": "from .x import X\n",
                "p/x.py": "from .y import Y\n",
                "p/y.py": "from resilient_ckpt.p import X\n",
            },
            ["p", "p.x", "p.y"],
        ),
        (
            {"p/__init__.py": "from . import x\n", "p/x.py": "from .. import p\n"},
            ["p", "p.x"],
        ),
    ],
)
def test_the_check_catches_a_cycle(tmp_path, files, expected) -> None:
    found = cycles(_fake_package(tmp_path, {"__init__.py": "", **files}))
    names = " / ".join(f"{PACKAGE}.{m}" for m in expected)
    assert list(found) == [frozenset(expected)], found
    text = found[frozenset(expected)]
    assert text.startswith(f"cycle {names}: ") and ".py:" in text, text


def test_imports_for_type_checking_and_one_way_imports_are_no_cycle(tmp_path) -> None:
    root = _fake_package(
        tmp_path,
        {
            "__init__.py": "from .p import X\n",
            "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n",
            "b.py": "import typing\nfrom . import a\n"
            "if typing.TYPE_CHECKING:\n    from .x import Y\n",
            "x.py": "from . import b\n",
            "p/__init__.py": "from .x import X\n",
            "p/x.py": "from .. import a, b\nfrom ..b import Z\n",
        },
    )
    assert cycles(root) == {}
