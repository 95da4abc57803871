"""``TensorAwareStateDict``: the interface between a user's state and the local manager.

Decision: a local checkpoint separates a state's *tensors* (moved as raw bytes: one flat
buffer, exchanged with peers in one message, written without pickling) from *everything
else* (pickled once, as a small "hollow" object whose tensors are placeholders recording
shape, dtype and device). These methods let the manager split a state without knowing its
structure; NVRx defines the same, so an NVRx implementation (Megatron-Core's) plugs in.
Pickling the whole state with ``torch.save`` instead would add a copy into a zip container,
could not travel as one buffer, and would allocate every tensor separately on load.

Call protocol (the manager, in the trainer, on every rank):

* save: ``pop_tensors()`` -> the hollow object is pickled -> ``insert_tensors(tensors)``
  with the very tensors popped, so the user's object is left as it was.
* load: the hollow object is unpickled -> ``insert_tensors(tensors)`` with CPU views of the
  loaded buffer -> ``restore_tensor_device()`` moves them to the device type they came from.
* ``copy_tensors_to_cpu`` / ``init_tensors``: NVRx interface for callers that stage or
  receive data themselves; the manager does not need them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, ValuesView
from typing import Any

import torch


class TensorAwareStateDict(ABC):
    """A state whose tensors can be taken out and put back (NVRx-compatible interface)."""

    @abstractmethod
    def pop_tensors(self) -> list[torch.Tensor]:
        """Remove the tensors, leaving placeholders; return them in a fixed order.

        Afterwards the object is *hollow* (picklable without tensor data). Popping from a
        hollow object is an error.
        """

    @property
    @abstractmethod
    def tensors(self) -> Iterable[torch.Tensor]:
        """The tensors, in the order ``pop_tensors`` returns them (not hollow only)."""

    @property
    @abstractmethod
    def is_hollow(self) -> bool:
        """True between ``pop_tensors`` and ``insert_tensors``/``init_tensors``."""

    @abstractmethod
    def insert_tensors(self, tensor_data: Iterable[torch.Tensor]) -> None:
        """Inverse of ``pop_tensors``: ``x.insert_tensors(x.pop_tensors())`` changes nothing."""

    @abstractmethod
    def init_tensors(self) -> None:
        """Fill a hollow object with uninitialised tensors of the recorded shape/dtype/device."""

    @abstractmethod
    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        """Replace the tensors by CPU copies (originals untouched); remember their devices."""

    @abstractmethod
    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """Move the tensors back to the devices they came from, where a move is needed."""

    def values(self) -> ValuesView[Any]:
        """The object's attributes (NVRx compatibility)."""
        return vars(self).values()
