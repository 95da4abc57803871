"""Device helpers of the replication layer (NVRx module path, kept for compatibility).

``TensorPlaceholder`` remembers what a tensor looks like (shape, dtype, device *type*) on the
``meta`` device, so a receiver can allocate the tensor a sender is about to send without
holding any data. The device is recorded by type only: a tensor sent from ``cuda:3`` lands
on the receiver's *current* CUDA device, because device indices differ between processes.
"""

from __future__ import annotations

import torch

from ...errors import ConfigurationError

__all__ = ["TensorPlaceholder", "get_default_device_from_type"]


def get_default_device_from_type(device_type: str) -> torch.device:
    """``cpu`` or the current CUDA device, for a device type name."""
    if device_type == "cpu":
        return torch.device("cpu")
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    raise ConfigurationError(
        f"device type {device_type!r} is not supported by replication (use 'cpu' or 'cuda')"
    )


class TensorPlaceholder:
    """Shape, dtype and device type of a tensor, without its data."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.hollow_tensor = torch.empty_like(tensor, device="meta")
        self.orig_device_type = tensor.device.type

    @property
    def device(self) -> torch.device:
        return get_default_device_from_type(self.orig_device_type)

    def empty_like(self, device: torch.device | str | None = None) -> torch.Tensor:
        """An uninitialised tensor like the original (on ``device``, default its type's)."""
        return torch.empty_like(
            self.hollow_tensor, device=self.device if device is None else device
        )

    def restore(self, data: torch.Tensor | None = None) -> torch.Tensor:
        """``data`` (checked against the recorded shape and dtype) on the original device
        type; an uninitialised tensor when ``data`` is None."""
        if data is None:
            return self.empty_like()
        if data.shape != self.hollow_tensor.shape or data.dtype != self.hollow_tensor.dtype:
            raise ConfigurationError(
                f"tensor {tuple(data.shape)} {data.dtype} does not match its placeholder "
                f"{tuple(self.hollow_tensor.shape)} {self.hollow_tensor.dtype}"
            )
        return data.to(self.device)
