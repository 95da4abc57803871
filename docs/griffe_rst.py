"""A Griffe extension: the reStructuredText subset of our docstrings, as Markdown.

The API reference is made by mkdocstrings from the docstrings, which read as design notes in
``help()`` and in an editor, so they are written in the small subset of reStructuredText
that reads well as plain text: double backquotes, ``:class:`` and friends, ``::`` before a
literal block, and the "simple table" of ``=`` rules. mkdocstrings renders Markdown, so this
extension rewrites each docstring once Griffe has loaded it (``mkdocs.yml`` names this file
under the Python handler's ``extensions``):

* a role (``:class:`~pkg.mod.Name```, ``:func:``, ``:mod:`` ...) becomes inline code, the
  target shortened to its last component where it starts with ``~``, as Sphinx shows it
  (not a link: many targets are private modules the reference leaves out, and a link that
  cannot resolve fails the strict build);
* a paragraph ending in ``::`` followed by an indented block becomes the paragraph (ending
  in ``:``) and a fenced block, marked Python when the block parses as Python;
* a simple table becomes a Markdown table.

Everything else (``*`` lists, ``**bold**``, Google-style ``Args:`` sections, which the
handler parses itself) is already Markdown.
"""

from __future__ import annotations

import ast
import re
import textwrap
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):`(~?)([^`]+)`")
_DOUBLE = re.compile(r"``([^`]+)``")
_RULE = re.compile(r"^=+(?:\s+=+)+\s*$")


def _role(match: re.Match[str]) -> str:
    target = match.group(2)
    if match.group(1):
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


def _inline(line: str) -> str:
    return _DOUBLE.sub(r"`\1`", _ROLE.sub(_role, line))


def _language(block: list[str]) -> str:
    try:
        ast.parse(textwrap.dedent("\n".join(block)))
    except SyntaxError:
        return "text"
    return "python"


def _columns(rule: str) -> list[tuple[int, int]]:
    return [(m.start(), m.end()) for m in re.finditer(r"=+", rule)]


def _table(lines: list[str]) -> list[str]:
    """A simple table (rule, header, rule, rows, rule) as Markdown rows."""
    spans = _columns(lines[0])

    def cells(line: str) -> list[str]:
        # The last column runs to the end of the line (it may overrun its rule).
        bounds = [(start, spans[i + 1][0]) for i, (start, _) in enumerate(spans[:-1])]
        bounds.append((spans[-1][0], len(line)))
        return [_inline(line[a:b].strip()) or " " for a, b in bounds]

    body = [line for line in lines[1:] if line.strip() and not _RULE.match(line)]
    header, rows = cells(body[0]), [cells(line) for line in body[1:]]
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(row) + " |" for row in rows]


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _literal_block(lines: list[str], start: int, outer: int) -> tuple[list[str], int]:
    """The block indented deeper than ``outer`` after a ``::`` line (blank lines inside
    kept), and where it ends; empty if the next line is not indented deeper."""
    i = start
    while i < len(lines) and not lines[i].strip():
        i += 1
    block: list[str] = []
    while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > outer):
        block.append(lines[i])
        i += 1
    while block and not block[-1].strip():
        block.pop()
    return textwrap.dedent("\n".join(block)).splitlines(), i


def rst_to_markdown(text: str) -> str:
    """The reStructuredText subset described in the module docstring, as Markdown."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        line = lines[i]
        if _RULE.match(line):
            end = i + 1
            rules = 1
            while end < len(lines) and rules < 3:
                rules += bool(_RULE.match(lines[end]))
                end += 1
            out.extend(["", *_table(lines[i:end]), ""])
            i = end
            continue
        if line.rstrip().endswith("::"):
            block, end = _literal_block(lines, i + 1, _indent(line))
            if block:
                lead = line.rstrip()[:-2].rstrip()
                if lead:
                    out.extend([_inline(lead) + ":", ""])
                bullet = line.lstrip().startswith(("* ", "- "))
                indent = " " * (_indent(line) + (2 if bullet else 0))
                fence = [f"```{_language(block)}", *block, "```"]
                out.extend([indent + f if f else "" for f in fence])
                out.append("")
                i = end
                continue
        out.append(_inline(line))
        i += 1
    return "\n".join(out)


class RstSubset(griffe.Extension):
    """Rewrites every loaded docstring with :func:`rst_to_markdown`."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rst_to_markdown(obj.docstring.value)
