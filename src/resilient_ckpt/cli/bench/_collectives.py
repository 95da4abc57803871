"""Counting the collectives a rank makes: calls, kinds, groups and payload bytes, by phase.

The coordination census of :mod:`.restore_scale` needs to know, for one steady-state save
and one restore, every collective each rank joins and how many bytes it puts in. The
library's collectives, torch DCP's (``_DistWrapper``) and torch's object collectives all go
through the functions of ``torch.distributed``, looked up by name when called (torch's
object collectives call its tensor collectives through its module's globals). So
:class:`CollectiveCensus` replaces those functions, in the process that installs it and
until it is removed, with wrappers that record each call, then call the original.

Decisions:

* **What counts as one collective.** A tensor collective is one synchronisation of the
  group, the unit the cost model prices (one latency per hop). An object collective
  (``all_gather_object``...) is not counted itself: the tensor collectives it makes are,
  labelled with it (``all_gather in all_gather_object``), since torch's makes two (sizes,
  then the padded bytes) and their payloads are what travels. A ``batch_isend_irecv`` is
  one call (its messages are posted together); the sends and receives inside it are not
  counted again.
* **Payload** is what the model prices: the bytes this rank contributes to the call (the
  input of an all-gather or gather, the tensor of an all-reduce or broadcast, a scatter's
  piece, the bytes sent by point-to-point calls). ``received`` is what arrived here (an
  all-gather's output, the coordinator's gather), which grows with the group by nature.
* **Phases.** Calls are recorded under the phase set by :meth:`CollectiveCensus.phase`
  (calls outside any phase are not recorded), so a benchmark can take apart one save:
  planning, each poll of the finalize, the commit.
* **In the benchmark's rank processes only**, never in the library: the wrappers are
  installed by the benchmark and removed by it; background workers are other processes
  and make no collectives.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ... import _dist

# How each tensor collective is priced (see .scale_model): kind, the argument holding this
# rank's contribution, the argument holding what arrives here.
_TENSOR_OPS: dict[str, tuple[str, str | None, str | None]] = {
    "all_gather": ("all_gather", "tensor", "tensor_list"),
    "all_gather_into_tensor": ("all_gather", "input_tensor", "output_tensor"),
    "all_gather_coalesced": ("all_gather", "input_tensor_list", "output_tensor_lists"),
    "all_reduce": ("all_reduce", "tensor", "tensor"),
    "all_reduce_coalesced": ("all_reduce", "tensors", "tensors"),
    "reduce": ("reduce", "tensor", None),
    "broadcast": ("broadcast", "tensor", "tensor"),
    "gather": ("gather", "tensor", "gather_list"),
    "scatter": ("scatter", "tensor", "tensor"),
    "reduce_scatter": ("reduce_scatter", "input_list", "output"),
    "reduce_scatter_tensor": ("reduce_scatter", "input", "output"),
    "all_to_all": ("all_to_all", "input_tensor_list", "output_tensor_list"),
    "all_to_all_single": ("all_to_all", "input", "output"),
    "barrier": ("barrier", None, None),
    "monitored_barrier": ("barrier", None, None),
    "send": ("p2p", "tensor", None),
    "isend": ("p2p", "tensor", None),
    "recv": ("p2p", None, "tensor"),
    "irecv": ("p2p", None, "tensor"),
    "batch_isend_irecv": ("p2p", None, None),
}
_OBJECT_OPS = (
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
)
# Rooted collectives: only the root contributes (broadcast, scatter) or receives (gather).
_ROOT_ARGS = {"broadcast": "src", "scatter": "src", "gather": "dst", "reduce": "dst"}


@dataclass(frozen=True)
class Call:
    """One collective this rank joined."""

    op: str  # the function called, with the object collective it ran in
    kind: str  # how the model prices it (a key of _TENSOR_OPS' kinds)
    group: str  # "default", "library", "library background" or "other (N ranks)"
    payload: int  # bytes this rank contributed
    received: int  # bytes that arrived here


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def group_name(group: Any) -> str:
    """A name for ``group`` that is the same on every rank."""
    if group is None or group is dist.group.WORLD:
        return "default"
    known = _dist.known_group_name(group)
    if known is not None:
        return known
    return f"other ({dist.get_world_size(group)} ranks)"


def _is_root(name: str, bound: dict[str, Any]) -> bool:
    """Whether this rank is the root of a rooted collective (a global rank, or a group rank
    in ``group_src``/``group_dst``)."""
    arg = _ROOT_ARGS[name]
    group = bound.get("group")
    root = bound.get(arg)
    if root is None:
        group_root = bound.get(f"group_{arg}")
        if group_root is None:
            return dist.get_rank() == 0
        return dist.get_rank(group) == group_root
    return dist.get_rank() == root


def _price(name: str, bound: dict[str, Any]) -> tuple[int, int]:
    """(payload, received) of one call of tensor collective ``name``."""
    kind, given, taken = _TENSOR_OPS[name]
    if name == "batch_isend_irecv":
        ops = bound.get("p2p_op_list") or []
        sends = sum(_nbytes(op.tensor) for op in ops if "send" in getattr(op.op, "__name__", ""))
        recvs = sum(_nbytes(op.tensor) for op in ops if "recv" in getattr(op.op, "__name__", ""))
        return sends, recvs
    payload = _nbytes(bound.get(given)) if given else 0
    received = _nbytes(bound.get(taken)) if taken else 0
    if name in _ROOT_ARGS:
        root = _is_root(name, bound)
        if kind == "broadcast":
            return (payload, 0) if root else (payload, received)
        if kind == "gather":
            return payload, received if root else 0
        if kind == "reduce":
            return payload, payload if root else 0
    return payload, received


class CollectiveCensus:
    """Records every collective of this process by phase while installed (a context
    manager: ``with CollectiveCensus() as census: with census.phase("plan"): ...``)."""

    def __init__(self) -> None:
        self.calls: dict[str, list[Call]] = {}
        self._phase: str | None = None
        self._originals: dict[str, Callable[..., Any]] = {}
        self._local = threading.local()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[list[Call]]:
        """Record the calls made in the ``with`` body under ``name``; yields their list."""
        outer, self._phase = self._phase, name
        try:
            yield self.calls.setdefault(name, [])
        finally:
            self._phase = outer

    def install(self) -> None:
        for name in (*_TENSOR_OPS, *_OBJECT_OPS):
            original = getattr(c10d, name, None)
            if original is None:  # not in this torch release
                continue
            self._originals[name] = original
            wrapper = self._wrap(name, original)
            setattr(c10d, name, wrapper)
            if getattr(dist, name, None) is original:
                setattr(dist, name, wrapper)

    def remove(self) -> None:
        for name, original in self._originals.items():
            if getattr(dist, name, None) is getattr(c10d, name):
                setattr(dist, name, original)
            setattr(c10d, name, original)
        self._originals.clear()

    def __enter__(self) -> CollectiveCensus:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)
        census = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            stack: list[str] = census._stack()
            if census._phase is not None and name in _TENSOR_OPS and not _in_tensor_op(stack):
                census._record(name, signature, args, kwargs, stack)
            stack.append(name)
            try:
                return original(*args, **kwargs)
            finally:
                stack.pop()

        wrapper.__name__ = getattr(original, "__name__", name)
        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        return wrapper

    def _stack(self) -> list[str]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _record(
        self,
        name: str,
        signature: inspect.Signature,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        stack: list[str],
    ) -> None:
        try:
            bound = signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            return  # a bad call: the original raises its own error
        group = bound.get("group")
        if name == "batch_isend_irecv":
            ops = bound.get("p2p_op_list") or []
            group = ops[0].group if ops else None
        payload, received = _price(name, bound)
        label = f"{name} in {stack[-1]}" if stack else name
        phase = self._phase
        if phase is not None:
            call = Call(label, _TENSOR_OPS[name][0], group_name(group), payload, received)
            self.calls.setdefault(phase, []).append(call)


def _in_tensor_op(stack: list[str]) -> bool:
    return bool(stack) and stack[-1] in _TENSOR_OPS
