"""The ```python blocks of the README and the docs pages, with what each says about running.

A block is run by ``tests/dist/test_docs_examples.py`` unless the line right before its
fence marks it otherwise. The two markers, HTML comments that neither GitHub nor the site
shows:

* ``<!-- run: torchrun --nproc-per-node N -->``: the block is a ``torchrun`` script; it runs
  under ``torchrun --standalone`` with N processes, as the page tells its reader to;
* ``<!-- not-run: REASON -->``: the block cannot run here (it needs a GPU, a bucket, a
  framework's model), and REASON says so.

Any other block runs as ``python main.py`` in a fresh directory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^<!--\s*(?P<kind>[a-z-]+):\s*(?P<text>.*?)\s*-->$")
TORCHRUN = re.compile(r"^torchrun --nproc-per-node (?P<n>[1-9][0-9]*)$")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    code: str
    nproc: int | None = None  # a torchrun script with this many processes
    not_run: str | None = None  # why it is not run

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


class MarkerError(ValueError):
    pass


def pages() -> list[Path]:
    return [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]


def _marked(block: Block, marker: re.Match[str]) -> Block:
    kind, text = marker["kind"], marker["text"]
    if kind == "not-run":
        if not text:
            raise MarkerError(f"{block.name}: not-run needs a reason")
        return Block(block.page, block.line, block.code, not_run=text)
    if kind == "run" and (launch := TORCHRUN.match(text)):
        return Block(block.page, block.line, block.code, nproc=int(launch["n"]))
    raise MarkerError(f"{block.name}: unknown marker {marker.group(0)!r}")


def blocks(page: Path) -> list[Block]:
    """The page's python blocks; a marker that precedes no python block is an error."""
    lines = page.read_text().splitlines()
    name = str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)
    found: list[Block] = []
    i = 0
    while i < len(lines):
        marker = MARKER.match(lines[i].strip())
        if marker and marker["kind"] in ("run", "not-run"):
            if i + 1 >= len(lines) or lines[i + 1].strip() != "```python":
                raise MarkerError(f"{name}:{i + 1}: a marker must sit right above a python block")
        if lines[i].strip() == "```python":
            end = lines.index("```", i + 1) if "```" in lines[i + 1 :] else len(lines)
            block = Block(name, i + 1, "\n".join(lines[i + 1 : end]) + "\n")
            before = MARKER.match(lines[i - 1].strip()) if i else None
            found.append(_marked(block, before) if before else block)
            i = end
        i += 1
    return found


def all_blocks() -> list[Block]:
    return [block for page in pages() for block in blocks(page)]


def runnable() -> list[Block]:
    """Each distinct runnable block once (a README block that repeats a guide's runs once)."""
    seen: dict[tuple[str, int | None], Block] = {}
    for block in all_blocks():
        if block.not_run is None:
            seen.setdefault((block.code, block.nproc), block)
    return list(seen.values())
