"""DCP load benchmark: ``dcp.load`` of a checkpoint our async writer saved, by reader.

N ranks (gloo) save one state (``--size`` per rank in ``--tensors`` tensors) with
``FileSystemWriterAsync`` on the persistent queue, then load it back with ``dcp.load``
through torch's ``FileSystemReader`` and through our ``CachedMetadataFileSystemReader``,
alternating, each from the disk (every rank evicts the checkpoint's files from the page
cache before each sample, see :func:`.common.evict`), next to a raw read of the same files
(each rank reads an equal share). Target: our reader at least as fast as torch's.

Usage: ``python -m resilient_ckpt.cli.bench.dcp_load [--ranks 2] [--size 128M]
[--tensors 64] [--repeats 3] [--dir DIR] [--json PATH]``
"""

from __future__ import annotations

import argparse
import functools
import glob
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ...async_ckpt.cached_metadata_filesystem_reader import CachedMetadataFileSystemReader
from ...async_ckpt.core import AsyncCallsQueue, AsyncRequest
from ...async_ckpt.filesystem_async import FileSystemWriterAsync
from ...async_ckpt.state_dict_saver import (
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from ...testing import launch
from .._help import plain
from ._output import progress, verdict
from .common import Figures, evict, parse_size, raw_read


def _state(rank: int, nbytes: int, tensors: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(rank)
    per = max(1, nbytes // tensors // 4)
    return {f"rank{rank}.layer{i}": torch.rand(per, generator=g) for i in range(tensors)}


def _save(path: str, state: dict[str, Any]) -> None:
    queue = AsyncCallsQueue(persistent=True)
    try:
        writer = FileSystemWriterAsync(path)
        plan = save_state_dict_async_plan(state, writer)
        save_fn, preload_fn, args = writer.get_save_function_and_args()
        finalize = functools.partial(save_state_dict_async_finalize, *plan)
        queue.schedule_async_request(AsyncRequest(save_fn, args, [finalize], preload_fn=preload_fn))
        queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    finally:
        queue.close()


def _timed(fn: Callable[[], Any], files: Sequence[str]) -> float:
    evict(files)
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _run(rank: int, world: int, root: str, nbytes: int, tensors: int, repeats: int) -> Any:
    path = os.path.join(root, "ckpt")
    state = _state(rank, nbytes, tensors)
    _save(path, state)
    files = sorted(glob.glob(os.path.join(path, "*.distcp")))
    share = files[rank::world]
    target = {k: torch.empty_like(v) for k, v in state.items()}

    def _load(reader: Any) -> Callable[[], None]:
        return lambda: dcp.load(target, storage_reader=reader(path))

    samples: dict[str, list[float]] = {}
    readers: dict[str, Callable[[str], Any]] = {
        "torch FileSystemReader": dcp.FileSystemReader,
        "CachedMetadataFileSystemReader": CachedMetadataFileSystemReader,
    }
    for repeat in range(repeats):
        if rank == 0:
            progress(f"dcp_load: round {repeat + 1} of {repeats} (raw read, torch's reader, ours)")
        samples.setdefault("raw read", []).append(_timed(lambda: raw_read(share), files))
        for name, reader in readers.items():
            samples.setdefault(name, []).append(_timed(_load(reader), files))
    if any(not torch.equal(target[k], v) for k, v in state.items()):
        raise RuntimeError("dcp.load returned different tensors than were saved")
    return {k: statistics.median(v) for k, v in samples.items()}


# DESIGN.md section 7, "load": load throughput / raw read of the same files.
LOAD_TARGET = ">= 0.8"


def report(t: dict[str, float], ranks: int, nbytes: int, repeats: int) -> Figures:
    total = ranks * nbytes / 1e9
    case = f"{ranks} ranks x {nbytes / 2**20:g} MiB"
    figures = Figures("dcp_load")
    torch_t, ours_t, raw_t = (
        t["torch FileSystemReader"],
        t["CachedMetadataFileSystemReader"],
        t["raw read"],
    )
    print(f"\nDCP load (dcp.load from disk, page cache evicted), {case}, median of {repeats}")
    print(f"{'reader':<32} {'seconds':>8} {'GB/s':>7}  {'vs raw read':>11}  {'vs torch':>8}")
    for name, seconds in (("raw read (same files)", raw_t), ("torch FileSystemReader", torch_t)):
        print(f"{name:<32} {seconds:8.3f} {total / seconds:7.2f}  {raw_t / seconds:11.2f}")
    print(
        f"{'CachedMetadataFileSystemReader':<32} {ours_t:8.3f} {total / ours_t:7.2f}  "
        f"{raw_t / ours_t:11.2f}  {torch_t / ours_t:8.2f}   (target: {LOAD_TARGET} vs raw "
        f"read, {verdict(LOAD_TARGET, raw_t / ours_t)})"
    )
    figures.add(
        "throughput", case, "dcp.load, our reader", total / ours_t, "torch reader", total / torch_t
    )
    figures.add(
        "throughput", case, "dcp.load, torch reader", total / torch_t, "raw read", total / raw_t
    )
    return figures


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=plain((__doc__ or "").split("\n")[0]))
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--size", type=parse_size, default=128 << 20, help="bytes per rank")
    p.add_argument("--tensors", type=int, default=64, help="tensors per rank")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="directory on the disk to measure")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    root = tempfile.mkdtemp(prefix="rc_dcp_load_", dir=args.dir)
    try:
        times = launch(
            _run,
            args.ranks,
            root,
            args.size,
            args.tensors,
            args.repeats,
            timeout=3600,
            start_method="spawn",
        )[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(times, args.ranks, args.size, args.repeats).write(
        args.json, ranks=args.ranks, size=args.size, repeats=args.repeats
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
