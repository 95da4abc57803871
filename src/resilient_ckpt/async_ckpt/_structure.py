"""The structure signature of a state dict: what a cached save plan depends on.

A DCP save plan depends on the state's *structure*, never on its values: the keys, whether
each value is a tensor, a DTensor, a ShardedTensor or a pickled object, and for tensors their
shape, dtype, ``requires_grad`` and (for sharded ones) which chunk this rank holds. It also
depends on who plans (planner type and settings, writer type, world size, rank, coordinator).

The signature is a 16-byte BLAKE2b digest of a textual description of all of that, computed
by walking the flattened state once (microseconds per entry: no write items are built, no
plan is pickled). Equal signatures on every rank imply equal local plans on every rank, hence
the same global plan, so a cached plan can be reused; the saver checks that with one small
collective. Deliberately left out: ``pin_memory`` (recorded by torch in the metadata but
irrelevant for loading, and querying it may touch the CUDA driver) and values.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .._torch_compat import DTensor, is_sharded_tensor
from ..errors import ConfigurationError


def check_state_dict(state_dict: Any) -> None:
    """A DCP state dict is a mapping with string keys at the top level.

    Nested dicts may use other keys (optimizer states use ints): DCP flattens them with
    ``str()``. A top-level non-string key would be saved under a key that cannot be loaded
    back, or collide with its string form, so it is refused here with the offending key.
    """
    if not isinstance(state_dict, Mapping):
        raise ConfigurationError(
            f"state_dict must be a dict with string keys, got {type(state_dict).__name__}"
        )
    for key in state_dict:
        if not isinstance(key, str):
            raise ConfigurationError(
                f"state_dict key {key!r} is a {type(key).__name__}; torch.distributed."
                "checkpoint needs string keys at the top level (use str(key))"
            )


def _describe(fqn: str, obj: Any) -> Any:
    kind = type(obj)
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        # The common case first, as a tuple: no string formatting per tensor.
        return (fqn, obj.shape, obj.dtype, obj.requires_grad, obj.layout)
    if isinstance(obj, DTensor):
        mesh = obj.device_mesh
        return (
            f"D|{fqn}|{tuple(obj.shape)}|{obj.dtype}|{obj.requires_grad}|"
            f"{tuple(mesh.shape)}|{mesh.get_coordinate()}|{obj.placements}"
        )
    if is_sharded_tensor(obj):
        md = obj.metadata()
        shards = [(s.metadata.shard_offsets, s.metadata.shard_sizes) for s in obj.local_shards()]
        return f"S|{fqn}|{tuple(md.size)}|{md.tensor_properties.dtype}|{shards}"
    if hasattr(obj, "__create_write_items__"):
        return f"C|{fqn}|{obj.__create_write_items__(fqn, obj)!r}"
    if isinstance(obj, torch.Tensor):
        return f"T|{fqn}|{tuple(obj.shape)}|{obj.dtype}|{obj.requires_grad}|{obj.layout}"
    return f"B|{fqn}"


def planner_settings(planner: Any) -> list[tuple[str, Any]]:
    """The planner's scalar attributes (its flags), sorted: part of what a plan depends on."""
    scalars = (bool, int, float, str, type(None))
    return sorted((k, v) for k, v in vars(planner).items() if isinstance(v, scalars))


def structure_signature(flat_state: Mapping[str, Any], context: Sequence[Any]) -> bytes:
    """Digest of the flattened state's structure plus ``context`` (who plans, see above)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr(tuple(context)).encode())
    digest.update(repr([_describe(fqn, obj) for fqn, obj in flat_state.items()]).encode())
    return digest.digest()
