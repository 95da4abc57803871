"""``BasicTensorAwareStateDict``: a ``TensorAwareStateDict`` over plain nested containers.

Tensors may sit anywhere in nested dicts, lists and tuples (named tuples included); other
values are pickled with the hollow object. Unlike NVRx's version, tensors may be on the CPU
as well as CUDA: each placeholder records its tensor's device, and ``restore_tensor_device``
returns every tensor to that device *type* (CUDA means the current CUDA device, as NVRx's
``.to("cuda")``, so a restarted job whose ranks map to other device indices still loads).

Dicts and lists are rewritten in place (the user's containers stay the same objects, as in
NVRx); a tuple holding a tensor is rebuilt in its parent. Tensors inside other objects are
not found: they are pickled with the hollow object, which works but bypasses the fast path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointingException
from .base_state_dict import TensorAwareStateDict

_DEVICES: dict[torch.device, torch.device] = {}


@dataclass(frozen=True)
class TensorPlaceholder:
    """What a popped tensor leaves behind: enough to allocate an equivalent tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, tensor: torch.Tensor, device: torch.device | None = None) -> TensorPlaceholder:
        device = device or tensor.device
        # One device object per device: a shard header then pickles it once, not once per
        # tensor (a torch.device pickles through a reduce call, most of a placeholder's cost).
        return cls(tuple(tensor.shape), tensor.dtype, _DEVICES.setdefault(device, device))

    def init_tensor(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=home_device(self.device))

    def __reduce__(self) -> tuple[Any, ...]:
        # A constructor call: faster and smaller to pickle than the dataclass default (the
        # instance dict rebuilt key by key), once per tensor of every shard header. Headers
        # pickled the default way still load.
        return (type(self), (self.shape, self.dtype, self.device))


def home_device(device: torch.device) -> torch.device:
    """Where a tensor saved from ``device`` goes back to in this process."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise CheckpointingException(
                f"a tensor was saved from {device} but CUDA is not available in this process; "
                "load on a machine with a GPU, or keep the tensors on the host by not calling "
                "restore_tensor_device"
            )
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _map_leaves(fn: Callable[[Any], Any], obj: Any) -> Any:
    """Apply ``fn`` to every leaf; dicts and lists in place, tuples rebuilt."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            obj[key] = _map_leaves(fn, value)
        return obj
    if isinstance(obj, list):
        for i, value in enumerate(obj):
            obj[i] = _map_leaves(fn, value)
        return obj
    if isinstance(obj, tuple):
        items = [_map_leaves(fn, v) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return fn(obj)


def _leaves(obj: Any) -> Iterator[Any]:
    if isinstance(obj, dict):
        for value in obj.values():
            yield from _leaves(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _leaves(value)
    else:
        yield obj


class BasicTensorAwareStateDict(TensorAwareStateDict):
    """Wraps ``state_dict`` (nested dicts/lists/tuples of tensors and plain values)."""

    def __init__(self, state_dict: Any) -> None:
        self.state_dict = state_dict
        self._is_hollow = False
        # Devices the current tensors must return to; None when they are already there.
        self._origin: list[torch.device] | None = None

    def _require(self, hollow: bool, what: str) -> None:
        if self._is_hollow != hollow:
            state = "hollow (tensors popped)" if self._is_hollow else "not hollow"
            raise CheckpointingException(f"{what} on a state dict that is {state}")

    @property
    def is_hollow(self) -> bool:
        return self._is_hollow

    def reusable_layout(self) -> bool:
        """Whether a shard layout planned for an equal structure fits this state: not
        hollow, and no tensor has to be recorded as coming from another device."""
        return not self._is_hollow and self._origin is None

    @property
    def tensors(self) -> Iterator[torch.Tensor]:
        self._require(False, "tensors")
        return (leaf for leaf in _leaves(self.state_dict) if isinstance(leaf, torch.Tensor))

    def pop_tensors(self) -> list[torch.Tensor]:
        self._require(False, "pop_tensors")
        popped: list[torch.Tensor] = []
        origin = self._origin

        def _pop(leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor):
                return leaf
            device = origin[len(popped)] if origin is not None else None
            popped.append(leaf)
            return TensorPlaceholder.of(leaf, device)

        self.state_dict = _map_leaves(_pop, self.state_dict)
        self._is_hollow = True
        self._origin = None
        return popped

    def insert_tensors(self, tensor_data: Iterable[torch.Tensor]) -> None:
        self._require(True, "insert_tensors")
        pending = iter(tensor_data)
        origin: list[torch.device] = []
        moved = False

        def _insert(leaf: Any) -> Any:
            nonlocal moved
            if not isinstance(leaf, TensorPlaceholder):
                return leaf
            tensor = next(pending, None)
            if tensor is None:
                raise CheckpointingException("insert_tensors got fewer tensors than placeholders")
            origin.append(leaf.device)
            moved = moved or tensor.device.type != leaf.device.type
            return tensor

        self.state_dict = _map_leaves(_insert, self.state_dict)
        if next(pending, None) is not None:
            raise CheckpointingException("insert_tensors got more tensors than placeholders")
        self._is_hollow = False
        self._origin = origin if moved else None

    def init_tensors(self) -> None:
        self._require(True, "init_tensors")

        def _init(leaf: Any) -> Any:
            return leaf.init_tensor() if isinstance(leaf, TensorPlaceholder) else leaf

        self.state_dict = _map_leaves(_init, self.state_dict)
        self._is_hollow = False
        self._origin = None

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        self._require(False, "copy_tensors_to_cpu")
        if self._origin is None:
            self._origin = [t.device for t in self.tensors]
        self.state_dict = _map_leaves(
            lambda x: x.to("cpu", non_blocking=non_blocking) if isinstance(x, torch.Tensor) else x,
            self.state_dict,
        )
        if non_blocking and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        self._require(False, "restore_tensor_device")
        if self._origin is None:
            return
        targets = iter([home_device(d) for d in self._origin])

        def _restore(leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor):
                return leaf
            target = next(targets)
            if leaf.device.type == target.type:
                return leaf
            return leaf.to(target, non_blocking=non_blocking and target.type == "cuda")

        self.state_dict = _map_leaves(_restore, self.state_dict)
        self._origin = None
