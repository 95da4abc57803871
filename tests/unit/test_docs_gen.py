"""docs/gen_api.py: the reStructuredText subset becomes Markdown; every listed module renders."""

from __future__ import annotations

import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "gen_api.py")


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("gen_api", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rst_subset_becomes_markdown(gen) -> None:
    text = gen.rst_to_md(
        """Uses :class:`~a.b.Writer` and ``x=1``. Example::

            queue = Queue()
            queue.close()

        Args:
            path: where it goes,
                on and on.
            flag: a switch.

        Done.
        """
    )
    assert "`a.b.Writer`" in text and "`x=1`" in text and "::" not in text
    assert "Example:\n\n```python\nqueue = Queue()\nqueue.close()\n```\n" in text
    assert "- `path`: where it goes, on and on.\n- `flag`: a switch." in text
    assert text.rstrip().endswith("Done.")


def test_every_public_module_has_a_page(gen) -> None:
    pages = gen.render()
    assert len(pages) == len(gen.MODULES) + 1
    for name, _ in gen.MODULES:
        text = pages[os.path.join(gen.OUT, f"{name}.md")]
        assert text.startswith(f"# `{name}`") and " at 0x" not in text
    core = pages[os.path.join(gen.OUT, "resilient_ckpt.async_ckpt.core.md")]
    assert "### class `AsyncCallsQueue`" in core and "schedule_async_request" in core
