"""Generate ``docs/api/*.md``, one page per public module, from the package's docstrings.

The docstrings are the reference (STYLE.md: module docstrings are design notes), so the pages
are generated rather than written twice; the output is committed so it reads on any Git
host. Run ``make docs`` after changing a public docstring or signature;
``python docs/gen_api.py --check`` exits 1 when the committed pages are out of date.

A page holds the module's docstring, then every public name (``__all__``, else the classes
and functions the module defines): its signature and docstring, and for a class its public
methods. The small subset of reStructuredText the docstrings use (double backquotes,
``:class:`` roles, ``::`` literal blocks) is turned into Markdown.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "api")

# (module, one-line role): the modules users import; underscore modules are internals.
MODULES = [
    ("resilient_ckpt", "top-level re-exports"),
    ("resilient_ckpt.async_ckpt.core", "the async queue, requests and callers"),
    ("resilient_ckpt.async_ckpt.torch_ckpt", "async torch.save"),
    ("resilient_ckpt.async_ckpt.filesystem_async", "the async DCP storage writer"),
    ("resilient_ckpt.async_ckpt.state_dict_saver", "async DCP plan / finalize, plan cache"),
    (
        "resilient_ckpt.async_ckpt.cached_metadata_filesystem_reader",
        "DCP reader with a metadata cache",
    ),
    ("resilient_ckpt.async_ckpt.verify", "checking a DCP checkpoint byte for byte"),
    ("resilient_ckpt.local.base_state_dict", "TensorAwareStateDict"),
    ("resilient_ckpt.local.basic_state_dict", "BasicTensorAwareStateDict"),
    ("resilient_ckpt.local.ckpt_managers.base_manager", "local checkpoint manager base"),
    ("resilient_ckpt.local.ckpt_managers.local_manager", "LocalCheckpointManager"),
    ("resilient_ckpt.local.replication.strategies", "clique replication"),
    ("resilient_ckpt.local.replication.group_utils", "process-group helpers for replication"),
    ("resilient_ckpt.tiered.manager", "tiered checkpointing: RAM tier + peer replicas + durable"),
    ("resilient_ckpt.storage", "storage backends"),
    ("resilient_ckpt.storage.base", "the storage backend interface"),
    ("resilient_ckpt.storage.posix", "the POSIX backend"),
    ("resilient_ckpt.integrations.lightning", "PyTorch Lightning plugin and callback"),
    ("resilient_ckpt.config", "timeouts and settings"),
    ("resilient_ckpt.errors", "the exception hierarchy"),
    ("resilient_ckpt.utils", "debug_time, preload_tensors, diff"),
    ("resilient_ckpt.testing.launcher", "multi-process test launcher"),
    ("resilient_ckpt.cli", "the resilient-ckpt command"),
    ("resilient_ckpt.demo.orchestrate", "what make demo runs"),
]

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):`~?([^`]+)`")


_SECTIONS = ("Args:", "Arguments:", "Returns:", "Raises:", "Attributes:", "Yields:")


def _sections_to_lists(lines: list[str]) -> list[str]:
    """Google-style ``Args:`` sections as Markdown lists (indented, they would read as code)."""
    out: list[str] = []
    in_section = False
    for line in lines:
        if line.strip() in _SECTIONS and not line.startswith(" "):
            in_section = True
            out.extend([f"**{line.strip()[:-1]}**", ""])
            continue
        if in_section and line.startswith("        ") and out:
            out[-1] += " " + line.strip()  # a continuation of the item above
        elif in_section and line.startswith("    ") and line.strip():
            head, sep, rest = line.strip().partition(": ")
            named = sep and " " not in head
            out.append(f"- `{head}`: {rest}" if named else f"- {line.strip()}")
        else:
            in_section = False  # a blank or unindented line ends the section
            out.append(line)
    return out


def rst_to_md(text: str) -> str:
    """The reStructuredText subset of our docstrings as Markdown."""
    text = inspect.cleandoc(text)
    text = _ROLE.sub(lambda m: f"`{m.group(1)}`", text)
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    lines, out, in_block = _sections_to_lists(text.splitlines()), [], False
    for i, line in enumerate(lines):
        if in_block and line.strip() and not line.startswith("    "):
            while out and not out[-1].strip():
                out.pop()
            out.append("```")
            out.append("")
            in_block = False
        if not in_block and line.rstrip().endswith("::") and i + 1 < len(lines):
            stripped = line.rstrip()[:-2].rstrip()
            out.append(stripped + ":" if stripped else "")
            out.append("")
            out.append("```python")
            in_block = True
            continue
        if in_block:
            if out[-1] == "```python" and not line.strip():
                continue  # the blank line after "::"
            out.append(line[4:] if line.startswith("    ") else line)
            continue
        out.append(line)
    if in_block:
        while out and not out[-1].strip():
            out.pop()
        out.append("```")
    return "\n".join(out).strip() + "\n"


class _Raw:
    """An annotation written as a string (``from __future__ import annotations``), unquoted."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _signature(obj: Any) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return ""
    params = [
        p.replace(annotation=_Raw(p.annotation)) if isinstance(p.annotation, str) else p
        for p in sig.parameters.values()
    ]
    ret = sig.return_annotation
    sig = sig.replace(
        parameters=params, return_annotation=_Raw(ret) if isinstance(ret, str) else ret
    )
    return re.sub(r" at 0x[0-9a-f]+", "", str(sig))


def _public_names(module: Any) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return sorted(
        name
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(obj) or inspect.isfunction(obj))
        and getattr(obj, "__module__", None) == module.__name__
    )


def _methods(cls: type) -> list[tuple[str, Any]]:
    found = []
    for name, obj in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(obj, (classmethod, staticmethod)):
            obj = obj.__func__
        if isinstance(obj, property):
            found.append((name, obj))
        elif inspect.isfunction(obj):
            found.append((name, obj))
    return found


def _describe(name: str, obj: Any, out: list[str]) -> None:
    if inspect.isclass(obj):
        bases = [b.__name__ for b in obj.__bases__ if b is not object]
        out.append(f"### class `{name}`\n")
        out.append(f"```python\nclass {name}{_signature(obj)}\n```\n")
        if bases:
            out.append(f"Bases: {', '.join(f'`{b}`' for b in bases)}\n")
        if obj.__doc__ and obj.__doc__ is not getattr(obj.__bases__[0], "__doc__", None):
            out.append(rst_to_md(obj.__doc__))
        for method_name, method in _methods(obj):
            if isinstance(method, property):
                out.append(f"#### `{name}.{method_name}` (property)\n")
            else:
                out.append(f"#### `{name}.{method_name}{_signature(method)}`\n")
            if method.__doc__:
                out.append(rst_to_md(method.__doc__))
    elif callable(obj):
        out.append(f"### `{name}{_signature(obj)}`\n")
        if obj.__doc__:
            out.append(rst_to_md(obj.__doc__))
    else:
        out.append(f"### `{name}`\n")
        out.append(f"A `{type(obj).__name__}`.\n")


def page(module_name: str, role: str) -> str:
    module = importlib.import_module(module_name)
    out = [f"# `{module_name}`: {role}\n"]
    out.append("<!-- generated by docs/gen_api.py from the docstrings; do not edit -->\n")
    if module.__doc__:
        out.append(rst_to_md(module.__doc__))
    names = _public_names(module)
    if names:
        out.append("## Public names\n")
        for name in names:
            _describe(name, getattr(module, name), out)
    return "\n".join(out).rstrip() + "\n"


def index() -> str:
    out = ["# API reference\n"]
    out.append("<!-- generated by docs/gen_api.py from the docstrings; do not edit -->\n")
    out.append(
        "One page per public module, generated from the docstrings by `docs/gen_api.py` "
        "(`make docs`). Modules whose names start with an underscore are internals. The "
        "quickstarts are in the project's README.\n"
    )
    for module_name, role in MODULES:
        out.append(f"- [`{module_name}`](api/{module_name}.md): {role}")
    return "\n".join(out) + "\n"


def render() -> dict[str, str]:
    """Every generated file, by path."""
    files = {os.path.join(HERE, "README.md"): index()}
    for module_name, role in MODULES:
        files[os.path.join(OUT, f"{module_name}.md")] = page(module_name, role)
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if pages are stale")
    args = parser.parse_args(argv)
    files = render()
    stale = []
    for path, text in files.items():
        try:
            with open(path) as f:
                current = f.read()
        except FileNotFoundError:
            current = None
        if current == text:
            continue
        stale.append(os.path.relpath(path, HERE))
        if not args.check:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
    known = {os.path.basename(p) for p in files}
    extra = [n for n in os.listdir(OUT) if n not in known] if os.path.isdir(OUT) else []
    if args.check:
        if stale or extra:
            print("out of date (run `make docs`): " + ", ".join(stale + extra), file=sys.stderr)
            return 1
        return 0
    for name in extra:
        os.unlink(os.path.join(OUT, name))
    print(f"{len(stale)} page(s) written, {len(extra)} removed, {len(files)} in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
