"""Saving a ``TensorAwareStateDict`` that cannot be taken apart, as one pickled object.

Some states implement only ``copy_tensors_to_cpu``, ``restore_tensor_device`` and pickling
(``pop_tensors`` raises ``NotImplementedError``); NVRx saves them whole with ``torch.save``
when replication is off, and its tests rely on it.

Decision: such a state is serialized *at save time*, in the trainer (``torch.save`` after
``copy_tensors_to_cpu``), into the single tensor of a :class:`WholeObject`, an ordinary shard
from then on: same file format, manifest, CRC, commit and replication (which exchanges
serialized shards, so it never needs the missing methods). It also makes the save a snapshot:
training may change the state once ``save`` returns, which NVRx's async path does not allow.
The cost is a full host copy in the trainer; states with ``pop_tensors`` keep the zero-copy
path. ``save`` refuses, naming the method, only a state that cannot reach the host at all.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from .. import _restricted_pickle
from ..errors import CheckpointingException, ConfigurationError
from .base_state_dict import TensorAwareStateDict

__all__ = ["WholeObject", "snapshot_whole"]


class WholeObject(TensorAwareStateDict):
    """A user's state as its ``torch.save`` bytes: a one-tensor ``TensorAwareStateDict``."""

    def __init__(self, data: torch.Tensor, type_name: str) -> None:
        self._data: torch.Tensor | None = data
        self._nbytes = int(data.numel())
        self.type_name = type_name

    @property
    def is_hollow(self) -> bool:
        return self._data is None

    @property
    def tensors(self) -> list[torch.Tensor]:
        if self._data is None:
            raise CheckpointingException("WholeObject is hollow")
        return [self._data]

    def pop_tensors(self) -> list[torch.Tensor]:
        popped = self.tensors
        self._data = None
        return popped

    def insert_tensors(self, tensor_data: Any) -> None:
        (self._data,) = list(tensor_data)

    def init_tensors(self) -> None:
        self._data = torch.empty(self._nbytes, dtype=torch.uint8)

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        """The bytes are on the host already."""

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """The bytes stay on the host; :meth:`unwrap` gives the user's object."""

    def unwrap(
        self, *, weights_only: bool = False, source: str = "local checkpoint shard"
    ) -> TensorAwareStateDict:
        """The user's object, as ``torch.load`` rebuilds it (tensors on the host).

        Trusted by default, as NVRx. ``weights_only`` (the managers' safe mode): the user's
        class must be marked safe (``torch.serialization.add_safe_globals``), or the load is
        refused, naming ``source``.
        """
        raw = self.tensors[0].numpy().tobytes()
        if weights_only:
            return _restricted_pickle.torch_load(raw, path=source)  # type: ignore[no-any-return]
        return torch.load(io.BytesIO(raw), weights_only=False)  # type: ignore[no-any-return]


def _missing(exc: BaseException, state: Any, method: str) -> ConfigurationError:
    return ConfigurationError(
        f"cannot save {type(state).__name__}: pop_tensors() is not implemented, so the state "
        f"is saved whole, which needs {method}() (it raised {type(exc).__name__}: {exc}). "
        "Implement pop_tensors/insert_tensors (saved tensor by tensor, zero-copy) or "
        "copy_tensors_to_cpu/restore_tensor_device (saved whole with torch.save)"
    )


def snapshot_whole(state: TensorAwareStateDict) -> WholeObject:
    """``state`` serialized now; ``state`` is left with its tensors on their devices."""
    try:
        state.copy_tensors_to_cpu(non_blocking=False)
    except NotImplementedError as exc:
        raise _missing(exc, state, "copy_tensors_to_cpu") from exc
    try:
        buffer = io.BytesIO()
        torch.save(state, buffer)
    except Exception as exc:
        raise ConfigurationError(
            f"cannot save {type(state).__name__} whole: torch.save failed with "
            f"{type(exc).__name__}: {exc}. Every attribute must be picklable (no lambdas, open "
            "files, locks or process groups)"
        ) from exc
    finally:
        try:
            state.restore_tensor_device(non_blocking=False)
        except NotImplementedError as exc:
            raise _missing(exc, state, "restore_tensor_device") from exc
    # No copy: the tensor keeps the buffer (and so the BytesIO) alive.
    data = torch.frombuffer(buffer.getbuffer(), dtype=torch.uint8)
    return WholeObject(data, type(state).__qualname__)
