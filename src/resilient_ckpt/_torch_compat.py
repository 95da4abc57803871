"""What differs between the torch releases the package supports (``torch>=2.4``).

One place for the names that moved or appeared after 2.4, so the rest of the package
imports them from here and reads the same on every release. (Torch 2.3's DCP lacks what the
async writer and readers build on, ``StorageMeta`` first: see the README, "Supported torch
releases".)
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DTensor",
    "Replicate",
    "Shard",
    "distribute_tensor",
    "has_stream_transforms",
    "no_dist_kwargs",
]

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
except ImportError:  # torch < 2.5: the same classes under their private module
    from torch.distributed._tensor import (  # type: ignore[no-redef]
        DTensor,
        Replicate,
        Shard,
        distribute_tensor,
    )


def has_stream_transforms(storage_data: Any, items: Any) -> bool:
    """Whether any read item's file data went through storage-writer stream transforms
    (torch 2.8 and later record them; earlier releases have none)."""
    return any(
        getattr(storage_data[item.storage_index], "transform_descriptors", None) for item in items
    )


def no_dist_kwargs(dcp_call: Any) -> dict[str, bool]:
    """Keyword arguments making ``dcp.save`` / ``dcp.load`` (``dcp_call``) run in this
    process alone: ``no_dist=True`` where the call takes it (torch 2.6 and later); none
    before, where the call runs alone whenever no default process group is initialised."""
    import inspect

    return {"no_dist": True} if "no_dist" in inspect.signature(dcp_call).parameters else {}
