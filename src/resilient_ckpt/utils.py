"""Small public helpers, NVRx-compatible: ``debug_time``, ``preload_tensors``, ``diff``."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import ContextDecorator
from typing import Any

import torch

_logger = logging.getLogger(__name__)


class debug_time(ContextDecorator):
    """Time a block or a function and log ``<name> took <seconds>s``.

    Usable as ``with debug_time("save"):`` and as ``@debug_time("save")``. Logs at
    ``level`` (DEBUG by default) on ``logger`` (this module's by default), only when the
    elapsed time is at least ``threshold`` seconds. The last measurement stays readable as
    ``.elapsed``.
    """

    def __init__(
        self,
        name: str,
        logger: logging.Logger | logging.LoggerAdapter | None = None,
        threshold: float = float("-inf"),
        level: int = logging.DEBUG,
    ) -> None:
        self.name = name
        self.logger = logger if logger is not None else _logger
        self.threshold = threshold
        self.level = level
        self.elapsed: float | None = None
        self._start = 0.0

    def __enter__(self) -> debug_time:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.elapsed = time.perf_counter() - self._start
        if self.elapsed >= self.threshold:
            self.logger.log(self.level, "%s took %.6fs", self.name, self.elapsed)


def _map_nested(fn: Callable[[Any], Any], obj: Any) -> Any:
    if isinstance(obj, dict):
        return type(obj)((k, _map_nested(fn, v)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_map_nested(fn, v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_map_nested(fn, v) for v in obj)
    return fn(obj)


def preload_tensors(state_dict: Any, non_blocking: bool = True) -> Any:
    """Return a copy of ``state_dict`` with every tensor on the host.

    Device tensors are copied to CPU (pinned, non-blocking copies when ``non_blocking`` and
    CUDA is in use; the caller synchronises). CPU tensors are *copied* too, detached, so the
    result never aliases training state. Nested dicts, lists and tuples are walked; other
    values are returned as they are.
    """

    def _preload(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        value = value.detach()
        if value.device.type == "cpu":
            return value.clone()
        return value.to("cpu", non_blocking=non_blocking)

    result = _map_nested(_preload, state_dict)
    if non_blocking and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return result


def _values_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        return bool(torch.equal(a.detach().cpu(), b.detach().cpu()))
    try:
        return bool(a == b)
    except Exception:
        return False


def _walk_diff(
    x1: Any, x2: Any, prefix: tuple, only_left: list, only_right: list, mismatch: list
) -> None:
    if isinstance(x1, dict) and isinstance(x2, dict):
        for key in x1.keys() - x2.keys():
            only_left.append(prefix + (key,))
        for key in x2.keys() - x1.keys():
            only_right.append(prefix + (key,))
        for key in x1.keys() & x2.keys():
            _walk_diff(x1[key], x2[key], prefix + (key,), only_left, only_right, mismatch)
    elif isinstance(x1, (list, tuple)) and isinstance(x2, (list, tuple)):
        common = min(len(x1), len(x2))
        only_left.extend(prefix + (i,) for i in range(common, len(x1)))
        only_right.extend(prefix + (i,) for i in range(common, len(x2)))
        for i in range(common):
            _walk_diff(x1[i], x2[i], prefix + (i,), only_left, only_right, mismatch)
    elif not _values_equal(x1, x2):
        mismatch.append((prefix, type(x1), type(x2)))


def diff(x1: Any, x2: Any, prefix: tuple = ()) -> tuple[list, list, list]:
    """Compare two nested structures (dicts, lists, tuples, tensors, plain values).

    Returns ``(only_left, only_right, mismatch)``: key paths present only in ``x1``, only in
    ``x2``, and paths whose values differ (as ``(path, type1, type2)``). Tensors compare by
    shape, dtype and exact values.
    """
    only_left: list = []
    only_right: list = []
    mismatch: list = []
    _walk_diff(x1, x2, prefix, only_left, only_right, mismatch)
    return only_left, only_right, mismatch


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor reachable through nested dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_tensors(v)


__all__ = ["debug_time", "diff", "iter_tensors", "preload_tensors"]
