"""The README and the docs as a product: short, undated, every python block run or excused,
and a CLI reference that names every verb and option the command has."""

from __future__ import annotations

import argparse
import re

import pytest

from resilient_ckpt.cli.command import build_parser
from tests._docs import ROOT, Block, MarkerError, all_blocks, blocks, pages, runnable

# A commit hash (7 to 40 hex digits with at least one digit and one letter) or a date.
_HASH = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
_DATE = re.compile(r"\b(?:19|20)\d\d-[01]\d-[0-3]\d\b")


def test_the_readme_is_short_and_its_first_example_is_the_plain_torch_save_script() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert "make test" in readme and "make demo" in readme  # CI runs the README's command
    first = next(b for b in blocks(ROOT / "README.md"))
    assert "TorchAsyncCheckpoint" in first.code and "os.makedirs(" in first.code
    assert "__main__" not in first.code


@pytest.mark.parametrize(
    "page", [*pages(), ROOT / "CHANGELOG.md"], ids=lambda p: str(p.relative_to(ROOT))
)
def test_no_commit_hash_or_date_in_the_readme_and_docs(page) -> None:
    text = page.read_text()
    assert not _HASH.findall(text), _HASH.findall(text)
    assert not _DATE.findall(text), _DATE.findall(text)


def test_every_python_block_is_run_or_says_why_not() -> None:
    found = all_blocks()
    assert len(found) >= 10
    excused = [b for b in found if b.not_run is not None]
    assert all(len(b.not_run.split()) >= 3 for b in excused), excused  # a reason, not a tag
    # The runnable ones are those tests/dist/test_docs_examples.py runs: every other block.
    assert {(b.code, b.nproc) for b in runnable()} == {
        (b.code, b.nproc) for b in found if b.not_run is None
    }


def test_markers_are_checked(tmp_path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- not-run: -->\n```python\nx = 1\n```\n")
    with pytest.raises(MarkerError, match="needs a reason"):
        blocks(page)
    page.write_text("<!-- run: torchrun --nproc-per-node 2 -->\n\n```python\nx = 1\n```\n")
    with pytest.raises(MarkerError, match="right above a python block"):
        blocks(page)
    page.write_text("<!-- run: python -->\n```python\nx = 1\n```\n")
    with pytest.raises(MarkerError, match="unknown marker"):
        blocks(page)
    page.write_text("text\n<!-- run: torchrun --nproc-per-node 4 -->\n```python\nx = 1\n```\n")
    (block,) = blocks(page)
    assert block == Block(str(page), 3, "x = 1\n", nproc=4)


def _cli_options(parser: argparse.ArgumentParser) -> list[str]:
    return [
        option
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    ]


def test_the_cli_reference_names_every_verb_and_option() -> None:
    page = (ROOT / "docs" / "cli.md").read_text()
    parser = build_parser()
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for verb, sub in verbs.choices.items():
        assert f"\n## {verb}\n" in page, verb
        missing = [o for o in _cli_options(sub) if f"`{o}" not in page and f" {o}" not in page]
        assert not missing, (verb, missing)
    assert all(f"`{o}`" in page for o in _cli_options(parser))


def test_the_top_level_page_names_every_re_export() -> None:
    import resilient_ckpt

    page = (ROOT / "docs" / "api" / "top.md").read_text()
    assert [n for n in resilient_ckpt.__all__ if f"`{n}`" not in page] == []


def test_the_docstrings_restructuredtext_subset_becomes_markdown() -> None:
    pytest.importorskip("griffe")  # the docs extra
    import importlib.util

    spec = importlib.util.spec_from_file_location("griffe_rst", ROOT / "docs" / "griffe_rst.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = """Uses :class:`~a.b.Writer`, :func:`a.b.f` and ``x=1``. Example::

    queue = Queue()

    queue.close()

* a bullet whose layout::

      offset 0   magic

Then:

=======  =========
name     default
=======  =========
``A_B``  1 s
C        the rest, longer than its rule
=======  =========
"""
    assert module.rst_to_markdown(text).splitlines() == [
        "Uses `Writer`, `a.b.f` and `x=1`. Example:",
        "",
        "```python",
        "queue = Queue()",
        "",
        "queue.close()",
        "```",
        "",
        "* a bullet whose layout:",
        "",
        "  ```text",
        "  offset 0   magic",
        "  ```",
        "",
        "Then:",
        "",
        "",
        "| name | default |",
        "|---|---|",
        "| `A_B` | 1 s |",
        "| C | the rest, longer than its rule |",
    ]
