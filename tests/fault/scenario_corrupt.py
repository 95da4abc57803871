"""Silent corruption and lost directories: detected, the other copy used or the save skipped.

Rows of the matrix, in one 4-rank job (cliques {0, 1} and {2, 3}, replication factor 2):

* ``byte_flip``: two checkpoints are committed, then one byte of the newer one is flipped
  (the trials cycle through the cases): a DCP data file (verification must name the file,
  the newest *verified* checkpoint is the older one and loads bit-exact); a local copy on
  its owner (``find_latest`` keeps the iteration, ``load`` takes the replica and is
  bit-exact); a local replica (the owner's copy is used); both copies of one shard (the
  iteration is skipped: the older one is found and loads bit-exact); a DCP data file
  corrupted on its way to storage, below the writer's checksum (as the DCP case).
* ``lose_dirs``: F-1 = 1 member of each clique, chosen at random, loses its whole
  directory; a restarted manager must find the newest iteration and load it bit-exact.

Every check runs on a fresh manager (a restart) so nothing cached in memory helps.
"""

from __future__ import annotations

import fnmatch
import os
import random
import shutil
import time
from typing import Any

import torch.distributed as dist

from resilient_ckpt.async_ckpt.verify import verify_checkpoint
from resilient_ckpt.cli.checkpoints import discover
from resilient_ckpt.errors import CorruptCheckpointError
from resilient_ckpt.local import BasicTensorAwareStateDict
from resilient_ckpt.local._manifest import DATA, file_name
from resilient_ckpt.testing.faults import Action, Fault, FaultyWriter, Phase, flip_byte

from . import _common as c

WORLD = 4
NBYTES = 128 << 10
FLIP_CASES = ("dcp", "own", "replica", "both", "dcp_write")
OLD, NEW = 1, 2


def _state(rank: int, iteration: int, t: int) -> dict[str, Any]:
    return c.tensor_state(rank, iteration, NBYTES, salt=100 + t)


def _rank_dir(root: str, rank: int) -> str:
    return os.path.join(root, "sess", str(rank))


def _dcp_trial(rank: int, root: str, t: int, rng: random.Random, in_flight: bool) -> str | None:
    """A byte flipped on disk after the save, or (``in_flight``) on its way to storage in
    rank 1's worker, below the writer's checksum (``Action.CORRUPT``)."""
    pattern = "__1_*.distcp"  # rank 1's data file (DCP names them __<rank>_<n>.distcp)
    corrupt = Fault(
        Phase.WRITE,
        Action.CORRUPT,
        ranks=(1,),
        match=pattern,
        after_bytes=rng.randrange(NBYTES // 2),
    )
    for iteration in (OLD, NEW):
        path = c.dcp_dir(root, iteration)
        faults = [corrupt] if in_flight and iteration == NEW else []
        writer = FaultyWriter(path, thread_count=1, faults=faults)
        c.dcp_request(_state(rank, iteration, t), path, writer=writer).execute_sync()
    dist.barrier()
    new = c.dcp_dir(root, NEW)
    files = sorted(n for n in os.listdir(new) if n.endswith(".distcp"))
    mine = [n for n in files if fnmatch.fnmatch(n, pattern)]
    if len(mine) != 1:
        return f"expected one file {pattern} among {files}"
    victim = mine[0]
    if not in_flight:
        victim = files[rng.randrange(len(files))]
        if rank == 0:
            flip_byte(os.path.join(new, victim), rng=rng)
    dist.barrier()
    try:
        verify_checkpoint(new)
        return f"verify_checkpoint missed the flipped byte in {victim}"
    except CorruptCheckpointError as exc:
        if victim not in str(exc):
            return f"the error does not name {victim}: {exc}"
    good = [e.iteration for e in discover(root, verify=True) if e.kind == "dcp" and e.verified]
    if good != [OLD]:
        return f"verified DCP checkpoints {good}, expected [{OLD}]"
    return c.load_dcp(root, OLD, _state(rank, OLD, t))


def _local_trial(rank: int, root: str, t: int, case: str, rng: random.Random) -> str | None:
    mgr = c.local_manager(root, replicated=True, keep_latest=2)
    for iteration in (OLD, NEW):
        mgr.save(BasicTensorAwareStateDict(_state(rank, iteration, t)), iteration)
    dist.barrier()
    owner = rng.randrange(WORLD)
    holder = owner ^ 1  # its clique peer, which holds the replica
    members = [rng.choice((0, 1)), rng.choice((2, 3))]  # F-1 = 1 member per clique
    if rank == 0:
        own = os.path.join(_rank_dir(root, owner), file_name(NEW, owner, DATA))
        replica = os.path.join(_rank_dir(root, holder), file_name(NEW, owner, DATA))
        if case in ("own", "both"):
            flip_byte(own, rng=rng)
        if case in ("replica", "both"):
            flip_byte(replica, rng=rng)
        if case == "lose":
            for member in members:
                shutil.rmtree(_rank_dir(root, member))
    dist.barrier()
    restarted = c.local_manager(root, replicated=True, keep_latest=2)
    wanted = OLD if case == "both" else NEW
    latest, bad = c.restore_local(restarted, lambda it: _state(rank, it, t))
    where = f"{case} (owner {owner}, lost {members if case == 'lose' else []})"
    if latest != wanted:
        return f"{where}: find_latest {latest}, expected {wanted}"
    return f"{where}: {bad}" if bad else None


def _job(rank: int, world: int, root: str, counts: dict[str, int], seed: int) -> dict:
    out: dict[str, list[c.Trial]] = {name: [] for name in counts}
    for row in ("byte_flip", "lose_dirs"):
        for t in range(counts.get(row, 0)):
            case = FLIP_CASES[t % len(FLIP_CASES)] if row == "byte_flip" else "lose"
            rng = random.Random(seed * 1009 + t * 2 + (row == "lose_dirs"))
            where = os.path.join(root, f"{row}{t}")
            started = time.monotonic()  # the trial's seconds: its saves, damage and checks
            try:
                if case.startswith("dcp"):
                    problem = _dcp_trial(rank, where, t, rng, in_flight=case == "dcp_write")
                else:
                    problem = _local_trial(rank, where, t, case, rng)
            except Exception as exc:  # a crash is a failed trial, not a lost job
                out[row].append(c.from_exception(case, exc))
                dist.barrier()
                continue
            seconds = time.monotonic() - started
            out[row].append(
                c.failed(problem, seconds) if problem else c.Trial(True, False, seconds)
            )
    return out


def run(workdir: str, counts: dict[str, int], seed: int = 0) -> dict[str, list[c.Trial]]:
    total = sum(counts.values())
    return c.launch_rows(_job, WORLD, workdir, counts, seed, counts=counts, timeout=90 + 20 * total)
