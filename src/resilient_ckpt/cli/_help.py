"""Help text for a terminal from docstrings, which are written for the docs site: their
reStructuredText markup (````code````, ``:mod:`.name```` and the other roles) made plain, so
``--help`` shows ``dcp.async_save``'s name, not the markup around it."""

from __future__ import annotations

import re

_ROLE = re.compile(r":(?:mod|class|func|meth|attr|data|exc|obj):`(?P<target>[^`]+)`")


def _role(match: re.Match[str]) -> str:
    target = match["target"]
    if target.startswith("~"):
        return target[1:].rsplit(".", 1)[-1]
    return target.lstrip(".")


def plain(text: str) -> str:
    """``text`` without reStructuredText inline markup."""
    return _ROLE.sub(_role, text).replace("``", "")
