"""Many consecutive async saves: no memory growth, no leaked segments, no new processes.

Row of the matrix: "100 consecutive saves". A 2-rank job saves, on one persistent-worker
queue, alternately an async DCP checkpoint (plan and metadata caches on, as in training)
and an async local checkpoint, finalizing each before the next (rank 0 deletes old DCP
checkpoints, as a retention policy would). After a warm-up (allocator pools, caches, the
worker's first imports) it records the resident memory of the trainer and of its worker,
the ``/dev/shm`` entries and the trainer's descendants; after ``saves`` more iterations the
memory of each may have grown by less than 1 %, and the other two must be unchanged.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import psutil
import torch.distributed as dist

from resilient_ckpt.local import BasicTensorAwareStateDict
from resilient_ckpt.testing.faults import descendants, worker_pids
from tests._helpers import shm_segments

from . import _common as c

WORLD = 2
NBYTES = 512 << 10
WARMUP = 10
MAX_GROWTH = 0.01


def _snapshot(queue: Any) -> dict[str, Any]:
    gc.collect()
    workers = worker_pids(queue)
    return {
        "trainer_rss": psutil.Process().memory_info().rss,
        "worker_rss": sum(psutil.Process(p).memory_info().rss for p in workers),
        "shm": shm_segments(),
        "procs": set(descendants()),
    }


def _job(rank: int, world: int, root: str, saves: int) -> list[c.Trial]:
    queue = c.new_queue("persistent")
    cache = c.CheckpointMetadataCache()
    mgr = c.local_manager(os.path.join(root, "local"), replicated=False)
    dcp_root = os.path.join(root, "dcp")
    states = {kind: c.tensor_state(rank, 0, NBYTES, salt=k) for k, kind in enumerate(("d", "l"))}
    before: dict[str, Any] = {}
    started = 0.0
    for iteration in range(WARMUP + saves):
        if iteration == WARMUP:
            dist.barrier()
            before, started = _snapshot(queue), time.monotonic()
        if iteration % 2 == 0:
            path = c.dcp_dir(dcp_root, iteration)
            queue.schedule_async_request(c.dcp_request(states["d"], path, cache))
        else:
            local = BasicTensorAwareStateDict(states["l"])
            queue.schedule_async_request(mgr.save(local, iteration, is_async=True))
        for state in states.values():
            c.mutate(state)
        queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
        if rank == 0 and iteration % 2 == 0 and iteration >= 4:
            c.drop_dcp(dcp_root, iteration - 4)
    dist.barrier()
    after = _snapshot(queue)
    seconds = time.monotonic() - started
    problems = []
    for key in ("trainer_rss", "worker_rss"):
        growth = (after[key] - before[key]) / before[key]
        # With a few MiB of slack for allocator arenas and lazy imports: a leak of one
        # snapshot per save would be NBYTES per save, many MiB over the run.
        if after[key] - before[key] >= max(MAX_GROWTH * before[key], 8 << 20):
            problems.append(f"{key} grew {growth:.2%} ({before[key]} -> {after[key]} bytes)")
    if after["shm"] - before["shm"]:
        problems.append(f"new /dev/shm entries {sorted(after['shm'] - before['shm'])}")
    if after["procs"] - before["procs"]:
        problems.append(f"new processes {sorted(after['procs'] - before['procs'])}")
    latest = mgr.find_latest()
    if latest != max(it for it in range(WARMUP + saves) if it % 2):
        problems.append(f"the newest local checkpoint is {latest}")
    queue.close()
    detail = f"rank {rank}, {saves} saves: " + "; ".join(problems)
    return [c.Trial(not problems, False, seconds, detail if problems else "")]


def run(workdir: str, saves: int = 100) -> dict[str, list[c.Trial]]:
    return {"soak": c.launch_trials(_job, WORLD, workdir, saves, trials=1, timeout=120 + 2 * saves)}
