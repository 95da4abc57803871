"""NVRx's ``BasicTensorAwareStateDict``, unpickled as ours (see :mod:`._nvrx_format`).

NVRx's class pickles ``state_dict`` and ``_is_hollow`` and holds CUDA tensors only (its
``restore_tensor_device`` moves every tensor to CUDA); ours also records each tensor's
origin, so the migrated object gets CUDA as every origin and is ours from then on.
"""

from __future__ import annotations

from typing import Any

import torch

from .basic_state_dict import BasicTensorAwareStateDict


class MigratedBasicStateDict(BasicTensorAwareStateDict):
    """Only ever seen during unpickling: ``__setstate__`` turns it into ours."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__class__ = BasicTensorAwareStateDict  # type: ignore[assignment]
        self.state_dict = state["state_dict"]
        self._is_hollow = bool(state.get("_is_hollow", False))
        self._origin = None
        if not self._is_hollow:
            self._origin = [torch.device("cuda") for _ in self.tensors]
