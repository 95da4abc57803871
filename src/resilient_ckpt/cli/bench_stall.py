"""Benchmark of the trainer's stall (issue 13): ours against memcpy and ``dcp.async_save``.

For each state shape (per rank: 2 MB in 64 tensors, 64 MB in 2000, 256 MB in 8) on
``--ranks`` gloo ranks, every rank measures, interleaved, ``--reps`` times after
``--warmups`` warm-up rounds:

* ``memcpy``: a single-thread copy (``memmove`` per tensor) of the same bytes into
  pre-faulted shared memory: the reference every stall is divided by;
* ``memcpy threads`` (CPU): the same copy split over as many threads as our copy pool uses
  (``min(4, cores / local ranks)``, ``RESILIENT_CKPT_COPY_THREADS``): what copying in
  parallel gains on this machine, printed when that is more than one thread;
* ``ours DCP``: ``save_state_dict_async_plan`` (plan cache on) + ``schedule_async_request``
  on a persistent ``AsyncCallsQueue``: plan + snapshot, the trainer's blocking time;
* ``ours torch``: ``TorchAsyncCheckpoint.async_save``; ``ours local``:
  ``LocalCheckpointManager.save(is_async=True)`` + scheduling;
* ``ours DCP telemetry``: ``ours DCP`` with OpenTelemetry on in the trainer (an SDK as an
  application configures it: a batch span processor, whose exporter drops the spans, and an
  in-memory metric reader); every other flow runs with the library's telemetry suspended, so
  on and off are timed in the same processes, interleaved;
* ``dcp.async_save``: process mode, torch's plan caching, its shared-memory stager (no
  pinned memory, no non-blocking copies: CPU);
* ``ours dcp.async_save``: :func:`resilient_ckpt.dcp.async_save` called as torchtitan calls
  torch's (a checkpoint id, the process executor); ``dcp.async_save + Stager``: the
  ``dcp.async_save`` flow with :class:`resilient_ckpt.dcp.Stager` in place of torch's
  ``DefaultStager`` (and the number of its arenas after the run);
* the overlapped modes (``overlap_staging=True``): the save call alone, and the later
  ``wait_for_snapshot``; ``ours DCP overlapped+defer`` plans at staging too
  (``defer_planning=True``), so the call leaves the planning to the staging thread;
  ``ours local overlapped``: the local save scheduled with ``overlap_staging=True``, and
  ``+defer`` with the manager's ``defer_planning`` on;
* the first save after the documented warm-up (median over ``--first-trials`` sets of fresh
  objects; ``warmup(state)``,
  :func:`resilient_ckpt.async_ckpt.warmup.warmup_async_save` for DCP,
  ``LocalCheckpointManager.warmup(state, queue)`` for local saves) against the
  steady-state median.

Every timed save (the references too) follows a pause of ``--gap-ms``, standing for the
training step between two saves: back to back, the previous save's clean-up in its worker
(releasing the request, a garbage collection) competes with the next save for the same
cores, which a training job's saves, seconds apart, never see (on 2 cores, the flow that
ran right after another one stalled longer).

With ``--device cuda`` the state lives on the GPU (rank r on device ``r % count``): the
reference is a pinned device-to-host copy of the same tensors, torch's stager gets pinned
memory and non-blocking copies, and a ``dcp.async_save overlapped`` row times torch's
background staging. A flow of torch's whose stager raises when reused (torch 2.11's pinned
stager did at its second save on an H100) goes on with a fresh stager per save, as torch makes
when none is passed, and says so; raising again, it is reported and left out. One of ours
raising ends the run.

DCP states are DTensor shards (every rank writes its own bytes); the other flows save the
local shards. Every save puts a new step number into the state, as a training loop does.
Figures are medians of the slowest rank per repetition. Optionally (``--memory-saves``) RSS
and staging memfds over that many saves of a fixed structure.
Not a test: the figures depend on the machine and its load; read the same-run ratios.

    python -m resilient_ckpt.cli.bench_stall --ranks 2 --reps 6
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

from .. import _telemetry
from .bench._output import progress
from .bench.stall_flows import (
    CPU_FLOWS,
    CUDA_FLOWS,
    DEFAULT_SHAPES,
    FLOWS,
    SHAPES,
    TELEMETRY_FLOW,
    Config,
    Flows,
    install_telemetry,
)
from .bench.stall_report import record, report

# Flows of torch's, not ours: one that fails (a torch release's own bug) is retried with a
# fresh stager per save, and if that fails too, reported and left out of the later
# repetitions instead of ending the run. The value: whether the flow is the overlapped one.
REFERENCE_FLOWS = {"dcp.async_save": False, "dcp.async_save overlapped": True}


def _run_flow(name: str, flow: Callable[[Flows], dict[str, float]], flows: Flows) -> Any:
    """The flow's figures, or (reference flows only) the failure as a string."""
    try:
        return flow(flows)
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        if name not in REFERENCE_FLOWS:
            raise
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def _clear_aftermath(device: str) -> None:
    """After a torch reference flow, outside every timing: collect its cyclic garbage (a
    save's stager, its staged copies, on torch 2.11 a fresh pinned stager per save) and
    let its device work finish, so that neither lands in whichever flow runs next (left to
    the collector, it did: a full collection landed in the next flow's stall and finalize).
    Our own flows' garbage is left to the collector, as in training."""
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()


def _rank_main(
    rank: int, world: int, cfg: Config
) -> tuple[dict[str, Any], dict[str, str], dict[str, str]]:
    warnings.filterwarnings("ignore")
    out: dict[str, Any] = {}
    failed: dict[str, str] = {}
    notes: dict[str, str] = {}
    every = {**FLOWS, **(CUDA_FLOWS if cfg.device == "cuda" else CPU_FLOWS)}
    chosen = {name: flow for name, flow in every.items() if name not in cfg.skip}
    if TELEMETRY_FLOW in chosen and not install_telemetry():
        del chosen[TELEMETRY_FLOW]
        failed[TELEMETRY_FLOW] = "the OpenTelemetry SDK is not installed (the otel extra)"
    for shape in cfg.shapes:
        with _telemetry.suspended():
            flows = Flows(rank, world, cfg, shape)
        samples: dict[str, list[float]] = {}
        for rep in range(cfg.warmups + cfg.reps):
            if rank == 0:
                kind = "warm-up" if rep < cfg.warmups else "measured"
                total = cfg.warmups + cfg.reps
                progress(f"stall {shape}: round {rep + 1} of {total} ({kind}), {len(chosen)} flows")
            for name, flow in chosen.items():
                if name in failed:
                    continue
                time.sleep(cfg.gap_s)  # the training step between two saves
                with nullcontext() if name == TELEMETRY_FLOW else _telemetry.suspended():
                    result = _run_flow(name, flow, flows)
                if name in REFERENCE_FLOWS:
                    _clear_aftermath(cfg.device)
                # Every rank drops a flow that failed on any, so all ranks stay in step.
                outcomes: list[Any] = [None] * world
                dist.all_gather_object(outcomes, result if isinstance(result, str) else None)
                errors = [o for o in outcomes if o is not None]
                if errors:
                    overlapped = REFERENCE_FLOWS[name]
                    if overlapped not in flows.fresh_stagers:  # once: reused stager failed
                        flows.fresh_stagers.add(overlapped)
                        notes[name] = f"{shape}: {errors[0]}"
                    else:
                        failed[name] = f"{shape}: {errors[0]}"
                    continue
                for key, value in result.items():
                    if rep >= cfg.warmups:
                        samples.setdefault(f"{name}|{key}", []).append(value)
        for name in failed:
            for key in [k for k in samples if k.startswith(f"{name}|")]:
                del samples[key]
        for name, value in flows.first.items():
            samples[f"{name}|first"] = [value]
        memory_shape = "64M/2000" if "64M/2000" in cfg.shapes else cfg.shapes[-1]
        with _telemetry.suspended():
            if cfg.memory_saves and shape == memory_shape:
                for key, value in flows.memory(cfg.memory_saves).items():
                    samples[f"memory|{key}"] = [value]
            flows.close()
        # The slowest rank of each repetition.
        for key, values in samples.items():
            worst = torch.tensor(values, dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            samples[key] = worst.tolist()
        out[shape] = {k: statistics.median(v) for k, v in samples.items()}
        # A finalize's rare long ones (a collector pass) are what a median hides.
        out[shape].update(
            {f"{k}_max": max(v) for k, v in samples.items() if k.endswith("|finalize")}
        )
        if rank == 0 and len(cfg.shapes) > 1:  # progress: this shape's rows now
            report({shape: out[shape]}, world, cfg.device, failed, notes)
    return out, failed, notes


def main(argv: list[str] | None = None) -> int:
    from ..testing.launcher import launch
    from ._help import plain

    parser = argparse.ArgumentParser(description=plain(__doc__.splitlines()[0]))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--warmups", type=int, default=2)
    parser.add_argument(
        "--shapes",
        default=",".join(DEFAULT_SHAPES),
        help=f"comma-separated, of {', '.join(SHAPES)} (default: {','.join(DEFAULT_SHAPES)})",
    )
    parser.add_argument("--memory-saves", type=int, default=50)
    parser.add_argument(
        "--first-trials", type=int, default=3, help="fresh objects whose first save is timed"
    )
    parser.add_argument(
        "--gap-ms",
        type=float,
        default=100.0,
        help="pause before every timed save, standing for the training step between saves",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the state lives; cuda: rank r on device r %% count, the reference is a "
        "pinned device-to-host copy",
    )
    parser.add_argument(
        "--skip",
        default="",
        help="flows to leave out, comma-separated, named as in the table (e.g. to see whether "
        "one flow's aftermath lands in the next one's stall)",
    )
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: /dev/shm)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    shapes = tuple(s for s in args.shapes.split(",") if s)
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shape(s) {unknown}; choose from {list(SHAPES)}")
    skip = tuple(s.strip() for s in args.skip.split(",") if s.strip())
    skippable = sorted((set(FLOWS) | set(CPU_FLOWS) | set(CUDA_FLOWS)) - {"memcpy"})
    unknown = [s for s in skip if s not in skippable]
    if unknown:
        parser.error(f"--skip: unknown or required flow(s) {unknown}; choose from {skippable}")
    if args.gap_ms < 0:
        parser.error(f"--gap-ms must be >= 0, got {args.gap_ms}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    base = args.dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    root = tempfile.mkdtemp(prefix="rc_bench_stall_", dir=base)  # after the checks: no leak
    cfg = Config(
        root,
        shapes,
        args.reps,
        args.warmups,
        args.memory_saves,
        max(1, args.first_trials),
        args.gap_ms / 1000,
        args.device,
        skip,
    )
    try:
        per_rank = launch(_rank_main, args.ranks, cfg, timeout=3600, start_method="spawn")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    figures, failed, notes = per_rank[0]
    print("\n== all shapes ==")
    report(figures, args.ranks, args.device, failed, notes)
    record(figures, args.ranks, args.device).write(
        args.json, ranks=args.ranks, reps=args.reps, device=args.device, failed=failed, notes=notes
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
