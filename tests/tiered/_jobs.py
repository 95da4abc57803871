"""Rank functions of the tiered tests (module-level: spawned ranks import them).

Each returns plain facts (steps, tiers, file names, booleans) that the test asserts on,
so an assertion failure reads as a difference of values, not as a remote traceback.
"""

from __future__ import annotations

import filecmp
import os
import shutil
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from resilient_ckpt.testing.faults import (
    MountUnavailable,
    fill_filesystem,
    flip_byte,
    small_filesystem,
)
from resilient_ckpt.tiered import TieredCheckpointManager

from ._app import App, reference, same, train


def manager(root: str, **kwargs: Any) -> TieredCheckpointManager:
    world = dist.get_world_size()
    options: dict[str, Any] = {
        "replication_factor": 2,
        "replication_jump": world // 2,
        "durable_every": 2,
        "keep_memory": 2,
        "keep_durable": 2,
    }
    options.update(kwargs)
    mem = options.pop("memory_dir", os.path.join(root, "mem"))
    return TieredCheckpointManager(mem, os.path.join(root, "durable"), **options)


def restore(root: str, **kwargs: Any) -> dict[str, Any]:
    """A fresh job's restore: step, tier, where each file came from, bit-exact or not."""
    app = App()
    mgr = manager(root, **kwargs)
    step = mgr.load(app.checkpoint())
    facts: dict[str, Any] = {"step": step}
    if step is not None:
        facts.update(
            tier=mgr.last_restore["tier"],
            files=mgr.last_restore["files"],
            exact=same(app.snapshot(), reference(step)),
        )
    mgr.close()
    return facts


def run(mgr: TieredCheckpointManager, app: App, steps: range) -> None:
    for step in steps:
        train(app, step)
        mgr.save(app.checkpoint(), step)
        mgr.maybe_finalize()


def layout(root: str) -> dict[str, Any]:
    mem = os.path.join(root, "mem")
    return {
        owner: {
            step: sorted(os.listdir(os.path.join(mem, owner, step)))
            for step in sorted(os.listdir(os.path.join(mem, owner)))
        }
        for owner in sorted(os.listdir(mem))
    }


def barrier() -> None:
    dist.barrier()


def four_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    """Behaviours 1-4 at 4 ranks (cliques {0,2} and {1,3}); leaves memory step 4 in the
    directories of ranks 2 and 3 for the elastic test that follows."""
    facts: dict[str, Any] = {}
    mgr = manager(root)
    app = App()
    run(mgr, app, range(1, 6))  # durable: the 2nd and 4th save
    mgr.maybe_finalize(blocking=True)
    caller = mgr.queue.persistent_caller
    assert caller is not None
    facts["staged_bytes"] = {
        step: caller.timings.get(i, {}).get("bytes") for i, step in enumerate(range(1, 6))
    }
    facts["timings"] = dict(caller.timings)
    mgr.close()
    barrier()
    durable4 = os.path.join(root, "durable", "step_000000004")
    mem4 = os.path.join(root, "mem", str(rank), "step_000000004")
    name = f"__{rank}_0.distcp"
    facts["durable_same_bytes"] = filecmp.cmp(
        os.path.join(durable4, name), os.path.join(mem4, name), shallow=False
    )
    facts["durable_dirs"] = sorted(os.listdir(os.path.join(root, "durable")))
    facts["layout"] = layout(root)
    # torch's own reader loads the durable tier
    plain = App()
    dcp.load(plain.checkpoint(), checkpoint_id=durable4)
    facts["torch_reads_durable"] = same(plain.snapshot(), reference(4))
    barrier()
    facts["restore"] = restore(root)
    # one flipped byte in rank 0's own copy: its replica (in rank 2's directory) serves
    barrier()
    if rank == 0:
        flip_byte(os.path.join(root, "mem", "0", "step_000000005", "__0_0.distcp"), 200)
    barrier()
    facts["restore_flipped"] = restore(root)
    # lose one member of every clique (ranks 0 and 1): peers' copies serve
    barrier()
    if rank == 0:
        shutil.rmtree(os.path.join(root, "mem", "0"))
        shutil.rmtree(os.path.join(root, "mem", "1"))
    barrier()
    facts["restore_lost"] = restore(root)
    # now the only copy of rank 2's step-5 file goes bad: step 5 is unusable -> step 4
    barrier()
    if rank == 0:
        flip_byte(os.path.join(root, "mem", "2", "step_000000005", "__2_0.distcp"), 100)
    barrier()
    facts["restore_older"] = restore(root)
    facts["layout_after"] = layout(root)
    return facts


def two_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    """Elastic 4 -> 2 from the memory tier (files of departed ranks 2, 3), then train on."""
    app = App()
    mgr = manager(root)
    step = mgr.load(app.checkpoint())
    facts: dict[str, Any] = {
        "step": step,
        "tier": mgr.last_restore["tier"],
        "files": mgr.last_restore["files"],
        "exact": same(app.snapshot(), reference(step or 0)),
    }
    run(mgr, app, range(5, 8))  # durable: the 2nd save after the load (step 6)
    mgr.close()
    barrier()
    facts["departed"] = {o: s for o, s in layout(root).items() if int(o) >= world}
    return facts


def four_again(rank: int, world: int, root: str) -> dict[str, Any]:
    """Elastic 2 -> 4 from memory; all memory lost -> durable; the RAM tier full."""
    facts: dict[str, Any] = {"elastic": restore(root)}
    barrier()
    if rank == 0:
        shutil.rmtree(os.path.join(root, "mem"))
    barrier()
    facts["durable"] = restore(root)
    facts["full"] = full_memory_tier(rank, root)
    return facts


def full_memory_tier(rank: int, root: str) -> dict[str, Any]:
    """A real full tmpfs: the save fails on every rank with a clear error, the previous
    commit stays loadable, and saving works again once there is room."""
    small = os.path.join(root, "small")
    mounted = [None]
    if rank == 0:
        try:
            ctx = small_filesystem(small, 1 << 20)
            ctx.__enter__()
            mounted[0] = ctx  # type: ignore[assignment]
        except MountUnavailable as exc:
            mounted[0] = None
            reason = str(exc)
    ok = [mounted[0] is not None]
    dist.broadcast_object_list(ok, src=0)
    if not ok[0]:
        return {"skipped": reason if rank == 0 else "no tmpfs"}
    facts: dict[str, Any] = {}
    kwargs = {"memory_dir": small, "durable_every": 1000}
    mgr = manager(os.path.join(root, "full"), **kwargs)
    app = App()
    train(app, 1)
    mgr.save(app.checkpoint(), 1)
    mgr.maybe_finalize(blocking=True)
    barrier()
    if rank == 0:
        fill_filesystem(small, 2048)
    barrier()
    train(app, 2)
    mgr.save(app.checkpoint(), 2)
    try:
        mgr.maybe_finalize(blocking=True)
        facts["error"] = None
    except Exception as exc:
        facts["error"] = f"{type(exc).__name__}: {exc}"
    barrier()  # every rank has cleaned up its own directory before raising
    facts["step2_dirs"] = sorted(
        o for o in os.listdir(small) if os.path.exists(os.path.join(small, o, "step_000000002"))
    )
    barrier()
    if rank == 0:
        os.unlink(os.path.join(small, ".filler"))
    barrier()
    train(app, 3)
    mgr.save(app.checkpoint(), 3)
    facts["after_room"] = mgr.maybe_finalize(blocking=True)
    mgr.close()
    facts["restore"] = restore(os.path.join(root, "full"), **kwargs)
    barrier()
    if rank == 0:
        mounted[0].__exit__(None, None, None)  # type: ignore[attr-defined]
    return facts


# -- crash trials (behaviour 6) ------------------------------------------------------------


def _resume(root: str) -> tuple[Any, Any, dict[str, Any]]:
    from resilient_ckpt.testing.faults import FaultyTieredCheckpointManager

    world = dist.get_world_size()
    mgr = FaultyTieredCheckpointManager(
        os.path.join(root, "mem"),
        os.path.join(root, "durable"),
        replication_factor=2,
        replication_jump=world // 2,
        durable_every=3,
    )
    app = App()
    step = mgr.load(app.checkpoint())
    facts = {
        "resumed": step,
        "exact": same(app.snapshot(), reference(step or 0)),
        "tier": mgr.last_restore["tier"] if step is not None else None,
    }
    return mgr, app, facts


def _save_finalized(mgr: Any, app: App, step: int) -> None:
    train(app, step)
    mgr.save(app.checkpoint(), step)
    mgr.maybe_finalize(blocking=True)


def crash_trial(rank: int, world: int, root: str, seed: int, kind: str) -> dict[str, Any]:
    """Resume (checking the state bit for bit), make two finalized saves, then crash in the
    way ``kind`` says; a trial whose crash kills a trainer never returns."""
    import random

    from resilient_ckpt.testing.faults import Action, Fault, Phase, kill_after, kill_at_tiered_phase
    from resilient_ckpt.tiered import TieredPhase

    rng = random.Random(seed)
    victim = rng.randrange(world)
    mgr, app, facts = _resume(root)
    step = facts["resumed"] or 0
    for _ in range(2):
        step += 1
        _save_finalized(mgr, app, step)
    facts["finalized"] = step
    if kind == "resume":
        facts["continued_exact"] = same(app.snapshot(), reference(step))
        mgr.close()
        return facts
    if kind == "worker":  # the victim's worker dies mid-write of its memory-tier file
        mgr.faults = [
            Fault(Phase.WRITE, Action.KILL, ranks=[victim], match="*.distcp", after_bytes=64)
        ]
        step += 1
        train(app, step)
        mgr.save(app.checkpoint(), step)
        try:
            mgr.maybe_finalize(blocking=True)
            facts["error"] = None
        except Exception as exc:
            facts["error"] = type(exc).__name__
        mgr.faults = []
        again = App()
        facts["reloaded"] = mgr.load(again.checkpoint())
        facts["reloaded_exact"] = same(again.snapshot(), reference(facts["reloaded"]))
        app, step = again, facts["reloaded"]
        for _ in range(2):  # and continues bit-exact
            step += 1
            _save_finalized(mgr, app, step)
        facts["continued_exact"] = same(app.snapshot(), reference(step))
        mgr.close()
        return facts
    if kind == "phase":
        phase = rng.choice(list(TieredPhase)[:4])
        kill_at_tiered_phase(mgr, phase, steps=[step + 1], ranks=[victim])
    elif rank == victim:  # "trainer": a random point of the next saves
        kill_after(os.getpid(), rng.uniform(0.0, 0.6))
    for _ in range(8):
        step += 1
        train(app, step)
        mgr.save(app.checkpoint(), step)
        mgr.maybe_finalize()
    mgr.maybe_finalize(blocking=True)
    mgr.close()
    return facts  # only reached if the kill missed every save (it should not)


def warmed_up(rank: int, world: int, root: str) -> dict[str, Any]:
    """``warmup`` before the first save: the worker is up before it, nothing is written, and
    the first save restores exactly."""
    app = App()
    train(app, 1)
    mgr = manager(root, durable_every=1)
    mgr.warmup(app.checkpoint())
    caller = mgr.queue.persistent_caller
    steps = [
        entry
        for tier in (os.path.join(root, "durable"), os.path.join(root, "mem", str(rank)))
        if os.path.isdir(tier)
        for entry in os.listdir(tier)
        if entry.startswith("step_")
    ]
    facts: dict[str, Any] = {
        "worker_up": caller is not None and caller._debug_is_async_process_running(),
        "nothing_written": not steps,
    }
    barrier()  # every rank looked before any saves
    mgr.save(app.checkpoint(), 1)
    mgr.maybe_finalize(blocking=True)
    mgr.close()
    barrier()
    facts["restore"] = restore(root)
    return facts
