"""The command-line package's modules import one way: no module imports another that
imports it back, directly or through others (lazy imports inside functions count, as in
``test_layering``). A helper two of them need lives in a module below both."""

from __future__ import annotations

import pytest

from tests.unit.test_layering import SRC, imports, modules

pytestmark = pytest.mark.timeout(60)

PREFIX = "resilient_ckpt.cli"


def _graph() -> dict[str, set[str]]:
    known = modules(SRC)
    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in known.items():
        if name == PREFIX or not name.startswith(PREFIX + "."):
            continue
        graph[name] = {
            imported
            for _, imported in imports(name, path, is_package, known)
            if imported.startswith(PREFIX + ".") and imported != name
        }
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order, the first again at the end)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_cli_modules_import_one_way() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle or [])


def test_the_check_finds_a_cycle_through_a_lazy_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
