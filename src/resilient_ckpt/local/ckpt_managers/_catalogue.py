"""Pure decisions over the job-wide catalogue of local checkpoint copies.

``find_latest`` all-gathers every rank's committed copies
(:class:`~resilient_ckpt.local._manifest.CopyInfo`); every rank runs these functions on the
same input, so all take the same decision without further messages.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from ...errors import ConfigurationError
from .._manifest import CopyInfo

Catalogue = Sequence[Sequence[CopyInfo]]


def candidate_iterations(catalogue: Catalogue, world_size: int, use_replicas: bool) -> list[int]:
    """Iterations, newest first, for which every shard has a committed copy somewhere
    (without replication only owners' own copies count, as in NVRx); checksums come later."""
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

    ``params``: each holder's replication parameters, by rank (or one for all); each holder's
    copies are compared with its own, so cliques of different sizes are fine. Replicated vs
    unreplicated is fine either way (replicas ignored, as NVRx documents); two *different*
    setups are an error: the holders of each shard would not be what the strategy assumes.
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
