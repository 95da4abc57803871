"""Trainer stall of an async save, against the memcpy floor and PyTorch's own async save.

For each size, in one run and on the same state: the blocking time of
``TorchAsyncCheckpoint.async_save`` and of a persistent-queue ``AsyncRequest``; a plain
``copy_`` of the same bytes into pre-allocated shared memory (the floor: any snapshot must
at least copy the bytes); a synchronous ``torch.save``; and
``torch.distributed.checkpoint.async_save`` in process mode (CPU staging options: no pinned
memory, no non-blocking copy). Medians of ``--repeats`` saves after a warm-up, each save
finalized (written) before the next, so every stall is measured on an idle writer.

    python benchmarks/async_save.py --sizes 64M,512M,2G
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (
    Figures,
    dd_write_seconds,
    human,
    make_state,
    median_time,
    parse_size,
    print_table,
)
from resilient_ckpt import AsyncCallsQueue, AsyncRequest, TorchAsyncCheckpoint
from resilient_ckpt.async_ckpt.torch_ckpt import save_atomically


def _floor(state: dict[str, torch.Tensor], repeats: int) -> float:
    total = sum(t.numel() * t.element_size() for t in state.values())
    buffer = torch.empty(total, dtype=torch.uint8).share_memory_()
    buffer.fill_(0)  # first touch outside the timing, as our arena is pre-faulted
    views, offset = [], 0
    for t in state.values():
        n = t.numel() * t.element_size()
        views.append((buffer[offset : offset + n], t.view(-1).view(torch.uint8)))
        offset += n

    def copy() -> None:
        for dst, src in views:
            dst.copy_(src)

    return median_time(copy, repeats)


def _ours_torch(state: dict, directory: str, repeats: int) -> tuple[float, float]:
    ckpt = TorchAsyncCheckpoint()
    path = os.path.join(directory, "ours_torch.pt")
    stall = median_time(
        lambda: ckpt.async_save(state, path),
        repeats,
        after=lambda: ckpt.finalize_async_save(blocking=True),
    )
    total = median_time(
        lambda: (ckpt.async_save(state, path), ckpt.finalize_async_save(blocking=True)),
        max(2, repeats // 2),
    )
    ckpt.close()
    return stall, total


def _ours_queue(state: dict, directory: str, repeats: int, persistent: bool = True) -> float:
    queue = AsyncCallsQueue(persistent=persistent)
    path = os.path.join(directory, "ours_queue.pt")

    def schedule() -> None:
        queue.schedule_async_request(AsyncRequest(save_atomically, (state, path), []))

    stall = median_time(
        schedule, repeats, after=lambda: queue.maybe_finalize_async_calls(blocking=True)
    )
    queue.close()
    return stall


def _torch_save(state: dict, directory: str, repeats: int) -> float:
    path = os.path.join(directory, "torch_save.pt")
    return median_time(lambda: torch.save(state, path), repeats)


def _dcp_async(state: dict, directory: str, repeats: int) -> tuple[float, float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    options = StagingOptions(
        use_pinned_memory=False,
        use_shared_memory=False,
        use_async_staging=False,
        use_non_blocking_copy=False,
    )
    stager = DefaultStager(options)
    futures: list = []
    counter = iter(range(1_000_000))

    def save() -> None:
        ckpt_dir = os.path.join(directory, f"dcp_{next(counter)}")
        response = dcp.async_save(
            state,
            checkpoint_id=ckpt_dir,
            async_stager=stager,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        )
        futures.append(response)

    def wait() -> None:
        response = futures.pop()
        upload = getattr(response, "upload_completion", response)
        upload.result()
        for name in os.listdir(directory):
            if name.startswith("dcp_"):
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)

    stall = median_time(save, repeats, after=wait)
    total = median_time(lambda: (save(), wait()), max(2, repeats // 2))
    stager.close()
    return stall, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64M,512M")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where checkpoints are written")
    parser.add_argument("--skip-dcp", action="store_true")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    directory = args.dir or tempfile.mkdtemp(prefix="rc_bench_")
    os.makedirs(directory, exist_ok=True)
    store = os.path.join(tempfile.mkdtemp(prefix="rc_store_"), "store")
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=0, world_size=1, timeout=timedelta(seconds=600)
    )
    AsyncCallsQueue.warmup_persistent_caller(0)
    rows = []
    figures = Figures("async_save")
    for size_text in args.sizes.split(","):
        nbytes = parse_size(size_text)
        case = human(nbytes)
        state = make_state(nbytes)
        floor = _floor(state, args.repeats)
        torch_stall, torch_total = _ours_torch(state, directory, args.repeats)
        queue_stall = _ours_queue(state, directory, args.repeats)
        fork_stall = _ours_queue(state, directory, args.repeats, persistent=False)
        sync = _torch_save(state, directory, args.repeats)
        dd = statistics.median(dd_write_seconds(directory, nbytes) for _ in range(args.repeats))
        measured = [
            ("memcpy floor (shm copy_)", floor, None),
            ("ours TorchAsyncCheckpoint.async_save", torch_stall, torch_total),
            ("ours AsyncCallsQueue request", queue_stall, None),
            ("ours AsyncCallsQueue(persistent=False), fork COW", fork_stall, None),
            ("torch.save (sync)", sync, sync),
            ("dd conv=fsync (raw write)", dd, dd),
        ]
        if not args.skip_dcp:
            dcp_stall, dcp_total = _dcp_async(state, directory, args.repeats)
            measured.append(("dcp.async_save (process)", dcp_stall, dcp_total))
        for name, stall, _ in measured[1:4]:
            figures.add("stall", case, name, stall, "memcpy floor", floor, "<= 1.1x floor")
        figures.add("stall", case, "torch.save (sync)", sync, "memcpy floor", floor)
        if not args.skip_dcp:
            figures.add("stall", case, "dcp.async_save (process)", dcp_stall, "memcpy floor", floor)
        figures.add(
            "throughput",
            case,
            "ours async_save, save->durable",
            nbytes / torch_total / 1e9,
            "dd conv=fsync",
            nbytes / dd / 1e9,
        )
        for name, stall, total in measured:
            rows.append(
                [
                    human(nbytes),
                    name,
                    f"{stall:.4f}",
                    f"{stall / floor:.2f}x",
                    f"{total:.3f}" if total is not None else "-",
                ]
            )
        if not args.skip_dcp:
            rows.append(
                [
                    human(nbytes),
                    "=> our stall / DCP async stall",
                    "",
                    f"{torch_stall / dcp_stall:.2f}",
                    "",
                ]
            )
        del state
    print_table(
        f"Trainer stall per save (median of {args.repeats}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads",
        ["size", "method", "stall s", "vs floor", "save->durable s"],
        rows,
    )
    figures.write(args.json, sizes=args.sizes, repeats=args.repeats)
    dist.destroy_process_group()
    shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
