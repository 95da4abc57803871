"""Groups of tensors that staging describes in one reducer call (see :mod:`._staging`).

Decision: per tensor, a reducer call and a descriptor pickled on its own cost ~1.5 us when
the tensors are cache-cold after a training step: a millisecond or more for a save of
thousands. Lists our own code builds (a DCP bucket's tensors, a local shard's) are known to
hold only tensors, so they travel as one blob of descriptors per list.

A :class:`SourcedBatch` goes one step further for the async DCP writer, whose buckets must
hand the worker *detached* tensors (new objects, so the buckets' tensors die with the
write): it is staged as the detached tensors would be (plain tensors without grad) without
making them. Detaching is ~1 us per tensor (a new tensor through the dispatcher), and for a
staged request nothing but the bytes and the layout ever leaves the trainer, so the
detached objects would be made only to be described and dropped.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class TensorBatch(list):
    """Tensors that staging describes in one reducer call: one pickled blob of descriptors
    per batch, not one per tensor.

    For lists our own code builds, whose elements are never the same tensor object as
    elsewhere in the request: unlike pickling them one by one, a batch does not share
    rebuilt *objects* with the rest of the request (storages are still shared: every slot
    is keyed by its storage). Unpickled, it is a plain list.
    """

    __slots__ = ()


class SourcedBatch:
    """A batch of tensors found only when staging meets it, staged as their ``detach()``.

    ``checked()`` gives the tensors to copy from, after every check its owner needs (for a
    full staging). ``quick()`` gives the same tensors found without the per-tensor checks,
    or None where it cannot: only the staging cache's optimistic pickle calls it, and that
    pickle is used only if the tensors' layout keys equal those of a previous *full*
    staging of the same request. The owner guarantees that equal keys imply the checks
    pass (e.g. a storage size check is implied by equal shapes, dtypes and storage sizes).

    Pickled by anything but staging, it is the plain list of the detached tensors.
    """

    __slots__ = ("checked", "quick")

    def __init__(
        self,
        checked: Callable[[], list[torch.Tensor]],
        quick: Callable[[], list[torch.Tensor] | None],
    ) -> None:
        self.checked = checked
        self.quick = quick

    def __reduce_ex__(self, protocol: object) -> tuple:
        return list, (list(map(torch.Tensor.detach, self.checked())),)
