"""State dicts and NVRx-layout writers for the local-checkpoint compatibility tests.

Imported by spawned ranks (and by ``torch.load`` when a checkpoint is read back), so every
class here must be importable at module level.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from typing import Any

import torch

from resilient_ckpt.local.base_state_dict import TensorAwareStateDict


class HostOnlyStateDict(TensorAwareStateDict):
    """Implements only what NVRx's own test state dict implements: ``copy_tensors_to_cpu``,
    ``restore_tensor_device`` and pickling; the tensor-aware methods raise."""

    def __init__(self, iteration: int, seed: int, count: int = 7, device: str = "cpu") -> None:
        g = torch.Generator().manual_seed(seed)
        self._tensors = [torch.randn(3 + i, 5, generator=g).to(device) for i in range(count)]
        self.iteration = iteration
        self._devices: list[torch.device] | None = None
        self.calls: list[str] = []

    def pop_tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError

    @property
    def tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError

    @property
    def is_hollow(self) -> bool:
        raise NotImplementedError

    def insert_tensors(self, tensor_data: Any) -> None:
        raise NotImplementedError

    def init_tensors(self) -> None:
        raise NotImplementedError

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        self.calls.append("copy_tensors_to_cpu")
        self._devices = [t.device for t in self._tensors]
        self._tensors = [t.to("cpu") for t in self._tensors]

    def restore_tensor_device(self, non_blocking: bool = False) -> None:
        self.calls.append("restore_tensor_device")
        if self._devices is not None:
            self._tensors = [t.to(d) for t, d in zip(self._tensors, self._devices, strict=True)]

    def same_values(self, other: Any) -> bool:
        return (
            isinstance(other, HostOnlyStateDict)
            and self.iteration == other.iteration
            and len(self._tensors) == len(other._tensors)
            and all(
                torch.equal(a.cpu(), b.cpu())
                for a, b in zip(self._tensors, other._tensors, strict=True)
            )
        )

    def clone(self) -> HostOnlyStateDict:
        copy = HostOnlyStateDict.__new__(HostOnlyStateDict)
        copy.__dict__.update(self.__dict__)
        copy._tensors = [t.clone() for t in self._tensors]
        copy.calls = []
        return copy


class NoHostCopyStateDict(HostOnlyStateDict):
    """Cannot be brought to the host either: nothing to save it with."""

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        raise NotImplementedError


class UnpicklableStateDict(HostOnlyStateDict):
    def __init__(self, iteration: int, seed: int) -> None:
        super().__init__(iteration, seed)
        self.hook = lambda: None


def write_like_nvrx(rank_dir: Path, iteration: int, owner: int, state: Any) -> Path:
    """One copy as NVRx's LocalCheckpointManager writes it: ``torch.save`` into the
    ``.dirty.pt`` name (after ``copy_tensors_to_cpu``), then a rename to the final name."""
    rank_dir.mkdir(parents=True, exist_ok=True)
    state.copy_tensors_to_cpu()
    dirty = rank_dir / f"iter_{iteration:07d}_{owner}_local.dirty.pt"
    with open(dirty, "xb") as f:
        torch.save(state, f)
    final = rank_dir / f"iter_{iteration:07d}_{owner}_local.pt"
    dirty.rename(final)
    return final


class _NvrxBasic:
    """Stands in for NVRx's BasicTensorAwareStateDict while a file is written: the same
    module path, class name and pickled attributes (``state_dict``, ``_is_hollow``)."""

    def __init__(self, state_dict: Any) -> None:
        self.state_dict = state_dict
        self._is_hollow = False

    def copy_tensors_to_cpu(self) -> None:
        """NVRx moves every tensor to the host before saving; these are there already."""


def write_nvrx_basic(path: Path, state_dict: Any) -> None:
    """``torch.save`` of an object pickled as NVRx's BasicTensorAwareStateDict, written in
    a process where that module exists (registered for the call only)."""
    names = [
        "nvidia_resiliency_ext",
        "nvidia_resiliency_ext.checkpointing",
        "nvidia_resiliency_ext.checkpointing.local",
        "nvidia_resiliency_ext.checkpointing.local.basic_state_dict",
    ]
    saved = {n: sys.modules.get(n) for n in names}
    module = types.ModuleType(names[-1])
    cls = type("BasicTensorAwareStateDict", (_NvrxBasic,), {"__module__": names[-1]})
    module.BasicTensorAwareStateDict = cls  # type: ignore[attr-defined]
    try:
        for name in names:
            sys.modules[name] = module if name == names[-1] else types.ModuleType(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(cls(state_dict), os.fspath(path))
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
