"""Pure decisions over the job-wide catalogue of local checkpoint copies.

``find_latest`` all-gathers, from every rank, the list of committed copies it holds
(:class:`~resilient_ckpt.local._manifest.CopyInfo`). Every rank then runs the functions
below on the same input, so every rank takes the same decision without further messages:
which iterations could be complete, and whether the manifests fit this job.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from ...errors import ConfigurationError
from .._manifest import CopyInfo

Catalogue = Sequence[Sequence[CopyInfo]]


def candidate_iterations(catalogue: Catalogue, world_size: int, use_replicas: bool) -> list[int]:
    """Iterations (newest first) for which every shard has a committed copy somewhere.

    Without replication only a rank's own copy counts (replicas are ignored, as in NVRx).
    Whether the copies are *valid* (checksums) is decided afterwards, newest first.
    """
    owners: dict[int, set[int]] = defaultdict(set)
    for holder, copies in enumerate(catalogue):
        for copy in copies:
            if use_replicas or copy.owner == holder:
                owners[copy.iteration].add(copy.owner)
    everyone = set(range(world_size))
    return sorted((it for it, found in owners.items() if everyone <= found), reverse=True)


def check_world_size(catalogue: Catalogue, world_size: int) -> None:
    """Local checkpoints are per rank: a job of another size cannot use them."""
    for holder, copies in enumerate(catalogue):
        for copy in copies:
            if copy.world_size != world_size:
                raise ConfigurationError(
                    f"local checkpoint {copy.path} (held by rank {holder}) was saved by a job "
                    f"of {copy.world_size} ranks, this job has {world_size}; restart with "
                    f"{copy.world_size} ranks, or use another directory or session_id"
                )


def check_replication(
    catalogue: Catalogue,
    iteration: int,
    params: dict[str, Any] | None | Sequence[dict[str, Any] | None],
) -> list[str]:
    """Raise if ``iteration`` was replicated differently; return notes worth a warning.

    ``params``: the replication parameters of every holder, by rank (or one value for all).
    Each holder's copies are compared with its own parameters, so cliques of different
    sizes are fine as long as every rank keeps its setup.

    A manager without replication may load a replicated checkpoint (the replicas are then
    ignored, as NVRx documents) and a replicating manager may load an unreplicated one;
    two *different* replication setups are an error, because the cliques, and so the
    holders of each shard, would not be what the strategy assumes.
    """
    notes = set()
    for holder, copies in enumerate(catalogue):
        mine = params[holder] if isinstance(params, Sequence) else params
        for copy in copies:
            if copy.iteration != iteration or copy.replication is None:
                continue
            if mine is None:
                if (copy.replication.get("factor") or 1) > 1:
                    notes.add(
                        f"iteration {iteration} was saved with replication "
                        f"{copy.replication} but this manager has no replication strategy: "
                        "replicas are ignored"
                    )
            elif copy.replication != mine:
                raise ConfigurationError(
                    f"local checkpoint {copy.path} (held by rank {holder}) was saved with "
                    f"replication {copy.replication}, that rank's manager uses {mine}; use the "
                    "same replication jump and factor (and world size) as when saving"
                )
    return sorted(notes)


def copies_of(catalogue: Catalogue, holder: int, iteration: int) -> list[CopyInfo]:
    return [c for c in catalogue[holder] if c.iteration == iteration]


def find_copy(catalogue: Catalogue, holder: int, iteration: int, owner: int) -> CopyInfo | None:
    for copy in catalogue[holder]:
        if copy.iteration == iteration and copy.owner == owner:
            return copy
    return None
