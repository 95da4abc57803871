"""Worker side of staging: a staged request unpickled over its arena (see :mod:`._staging`).

Each descriptor the trainer pickled in place of a tensor (or a batch of them) is rebuilt as
a tensor whose storage is exactly its slot of the arena: one storage per slot, so views and
tied weights stay shared as ``torch.save`` would see them. The arena and slots of the
request being unpickled are per-thread context, set only inside :func:`unstage`.
"""

from __future__ import annotations

import pickle
import threading
from typing import Any

import torch

from .._torch_compat import pending_sparse_tensors, validate_loaded_sparse_tensors
from ..errors import StagingError
from ._arena import Arena
from ._worker import Slot


class _UnstageContext(threading.local):
    arena: Arena | None = None
    slots: tuple[Slot, ...] = ()
    storages: dict[int, torch.UntypedStorage] | None = None


_unstaging = _UnstageContext()


def rebuild_staged(
    slot: int,
    dtype: torch.dtype,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    offset: int,
    requires_grad: bool,
    is_param: bool,
) -> torch.Tensor:
    """Worker side: a tensor whose storage is its slot of the arena being unstaged."""
    storages = _unstaging.storages
    if storages is None:
        raise StagingError("a staged tensor was unpickled outside of unstage()")
    storage = storages.get(slot)
    if storage is None:
        arena = _unstaging.arena
        if arena is None:
            raise StagingError("request references staged tensors but no arena")
        offset_in_arena, nbytes = _unstaging.slots[slot]
        storage = arena.view(offset_in_arena, nbytes).untyped_storage()
        storages[slot] = storage
    tensor = torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)
    if is_param:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor


def rebuild_batch(descriptors: bytes) -> list[torch.Tensor]:
    """Worker side: a :class:`TensorBatch`'s tensors, each over its slot."""
    return [rebuild_staged(*args) for args in pickle.loads(descriptors)]


def unstage(payload: bytes, arena: Arena | None, slots: tuple[Slot, ...]) -> Any:
    """Worker side: unpickle a staged request; its tensors view ``arena``."""
    _unstaging.arena, _unstaging.slots, _unstaging.storages = arena, slots, {}
    try:
        obj = pickle.loads(payload)
    except BaseException:
        pending_sparse_tensors().clear()
        raise
    finally:
        _unstaging.arena, _unstaging.slots, _unstaging.storages = None, (), None
    # What torch.load does after unpickling: torch's sparse-tensor rebuild puts every sparse
    # tensor on a process-wide list to validate once its storages are loaded. Not emptied
    # here, the list would keep them (and the arena memory they view) alive until some later
    # torch.load in this process validates them, by then over reused memory (torch 2.5 then
    # fails that unrelated load: "size is inconsistent with indices").
    validate_loaded_sparse_tensors()
    return obj
