"""Are these tensors laid out as the ones a save staged before? The staging cache's check.

Every tensor must have the previous save's *layout*, position by position::

    type, device, layout, dtype, shape, stride, requires_grad, conjugate and negative bits,
    storage offset, storage address, storage bytes

(equal layouts mean equal staging descriptors, slot grouping and copy ranges, see
:mod:`._stage_cache`).

Decision: **the first seven fields are checked in C++ by PyTorch's own tensor guard** (the
check ``torch.compile`` runs before every call of a compiled function, on every input
tensor: its Python type, dispatch keys, which hold the device and layout, dtype, device
index, ``requires_grad``, sizes and strides), the storage fields by C-level passes here.
Read from Python, the seven fields are six attribute calls and five new objects per tensor
(a ``torch.Size``, a stride tuple, a ``device``...) and one more pass to compare them with the
previous save's: at 2000 tensors, cache-cold after a training step, ~2.4 ms of a 2-rank
save's stall here against ~10 for the whole save. The guard is ~0.3 ms cold.

The guard is a private class (``torch._C._dynamo.guards.TensorGuards``, unchanged in its
call since torch 2.1). It is used only after a probe at first use shows it tells apart each
field this check needs; where it is missing, raises, or does not, the same fields are read
from Python (:func:`meta_keys`). It is always built with both keyword arguments, which
its constructor reads unchecked (``None`` for both: every size and stride is static). It
holds no reference to the tensors. It fails for a tensor object met twice (``torch.compile``
has its inputs deduplicated), so requests holding one are checked from Python; a request
that newly holds one just misses. It compares dispatch keys under the thread's dispatch
state at its construction, so a save under another state (``inference_mode``) only misses.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._logging import get_logger

logger = get_logger(__name__)

# One C-level call per tensor for the fields that are plain attributes.
_ATTRIBUTES = operator.attrgetter("device", "layout", "dtype", "shape", "requires_grad")


def meta_keys(tensors: Sequence[torch.Tensor]) -> tuple[list, ...]:
    """Type, device, layout, dtype, shape, ``requires_grad``, stride and the conjugate and
    negative bits as columns, one list per field, each filled by a C-level ``map`` (the check
    without the guard). Raises for tensors without strides."""
    return (
        list(map(type, tensors)),
        list(map(_ATTRIBUTES, tensors)),
        list(map(torch.Tensor.stride, tensors)),
        list(map(torch.Tensor.is_conj, tensors)),
        list(map(torch.Tensor.is_neg, tensors)),
    )


def storage_keys(tensors: Sequence[torch.Tensor]) -> tuple[list, ...]:
    """Storage offset, storage address and storage bytes as columns. Raises for tensors
    without a strided storage."""
    storages = list(map(torch.Tensor.untyped_storage, tensors))
    return (
        list(map(torch.Tensor.storage_offset, tensors)),
        list(map(torch.UntypedStorage.data_ptr, storages)),
        list(map(torch.UntypedStorage.nbytes, storages)),
    )


def _guard_factory() -> Callable[[Sequence[torch.Tensor]], Any] | None:
    """How to build PyTorch's tensor guard, if this torch has one that checks every field
    the layout needs (probed once); else None."""
    try:
        from torch._C._dynamo.guards import TensorGuards
    except Exception:  # no dynamo in this build
        return None

    def make(tensors: Sequence[torch.Tensor]) -> Any:
        return TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)

    try:
        base = [torch.zeros(4), torch.zeros(2, 3)]
        guard = make(base)
        others = [
            [torch.zeros(5), base[1]],  # shape
            [torch.zeros(4, dtype=torch.float64), base[1]],  # dtype
            [torch.zeros(4, dtype=torch.int32), base[1]],  # dtype of the same size
            [torch.zeros(4, requires_grad=True), base[1]],  # requires_grad
            [torch.nn.Parameter(torch.zeros(4), requires_grad=False), base[1]],  # type
            [torch.zeros(4, device="meta"), base[1]],  # device
            [base[0], torch.zeros(3, 2).t()],  # stride
            [torch.zeros(4).to_sparse(), base[1]],  # layout
        ]
        complex_ = torch.zeros(2, dtype=torch.complex64)
        lazy = make([complex_])  # the conjugate and negative bits (views of the same bytes)
        bits = [complex_.conj(), torch._neg_view(complex_)]
        if (
            guard.check(*base)
            and not any(guard.check(*other) for other in others)
            and lazy.check(complex_)
            and not any(lazy.check(other) for other in bits)
        ):
            return make
        logger.debug("torch's tensor guard misses a layout field; checking from Python")
    except Exception as exc:  # a changed private interface
        logger.debug("torch's tensor guard is unusable (%r); checking from Python", exc)
    return None


@functools.cache
def guard_factory() -> Callable[[Sequence[torch.Tensor]], Any] | None:
    """:func:`_guard_factory`, probed once per process."""
    return _guard_factory()


class MetaCheck:
    """Type, device, layout, dtype, shape, stride and ``requires_grad`` of ``tensors``, to
    compare later tensors with, position by position: by PyTorch's guard where it is usable
    (see the module docstring), else from Python. Raises for tensors without strides."""

    __slots__ = ("_count", "_guard", "_keys")

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        make = guard_factory()
        if make is not None and len(set(map(id, tensors))) != len(tensors):
            make = None  # the guard refuses a tensor passed twice
        self._count = len(tensors)
        self._guard = make(tensors) if make is not None else None
        self._keys = meta_keys(tensors) if make is None else ()

    @property
    def native(self) -> bool:
        """Whether PyTorch's guard does the check."""
        return self._guard is not None

    def matches(self, tensors: Sequence[torch.Tensor]) -> bool:
        if len(tensors) != self._count:
            return False
        try:
            if self._guard is None:
                return meta_keys(tensors) == self._keys
            return bool(self._guard.check(*tensors))
        except Exception:  # e.g. a sparse tensor (no strides): not the layout checked
            return False


class LayoutCheck:
    """The whole layouts of ``tensors`` (:class:`MetaCheck` and the storage fields).

    Raises for tensors without a strided storage (the caller stages such requests fully).
    """

    __slots__ = ("_meta", "_storage")

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._meta = MetaCheck(tensors)
        self._storage = storage_keys(tensors)

    @property
    def native(self) -> bool:
        return self._meta.native

    def matches(self, tensors: Sequence[torch.Tensor]) -> bool:
        if not self._meta.matches(tensors):
            return False
        try:
            return storage_keys(tensors) == self._storage
        except Exception:  # a tensor without a strided storage
            return False
