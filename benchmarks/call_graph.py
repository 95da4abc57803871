"""How much of the library one steady async DCP save runs in the trainer, and how often control
crosses between its modules: the wiring a newcomer has to follow from the call to the commit.

One rank (a gloo group of one), a state of ``--tensors`` small tensors, the plan cache on.
After ``--warmups`` saves (the first plans fully, the next ones are steady), one more save is
traced: planning (``save_state_dict_async_plan``), scheduling (``schedule_async_request``)
and the blocking finalize, with a profile function on every thread of the trainer process
(the staging and receiving threads included; the background worker is another process).
Printed: the modules of ``resilient_ckpt`` that ran, and the calls from one of them into
another, with the busiest pairs.

    python benchmarks/call_graph.py --tensors 200
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import tempfile
import threading
from datetime import timedelta
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

PACKAGE = "resilient_ckpt"


class Trace:
    """Counts Python calls between our modules while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.lock = threading.Lock()
        self.modules: set[str] = set()
        self.crossings: collections.Counter[tuple[str, str]] = collections.Counter()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.on or event != "call":
            return
        callee = frame.f_globals.get("__name__", "")
        if not callee.startswith(PACKAGE):
            return
        caller_frame = frame.f_back
        caller = caller_frame.f_globals.get("__name__", "") if caller_frame else ""
        with self.lock:
            self.modules.add(callee)
            if caller.startswith(PACKAGE) and caller != callee:
                self.crossings[(caller, callee)] += 1


def _save(state: dict, directory: str, step: int, queue: Any, cache: Any) -> None:
    from resilient_ckpt.async_ckpt.core import AsyncRequest
    from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
    from resilient_ckpt.async_ckpt.state_dict_saver import (
        save_state_dict_async_finalize,
        save_state_dict_async_plan,
    )

    writer = FileSystemWriterAsync(os.path.join(directory, f"step_{step}"), thread_count=1)
    ret = save_state_dict_async_plan(state, writer, enable_cache=True, metadata_cache=cache)
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    finalize = functools.partial(save_state_dict_async_finalize, *ret)
    queue.schedule_async_request(AsyncRequest(save_fn, args, [finalize], preload_fn=preload_fn))
    queue.maybe_finalize_async_calls(blocking=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--warmups", type=int, default=3)
    parser.add_argument("--top", type=int, default=12, help="busiest module pairs shown")
    args = parser.parse_args()

    trace = Trace()
    sys.setprofile(trace)
    threading.setprofile(trace)  # threads started from now on: the queue's own

    from resilient_ckpt.async_ckpt.core import AsyncCallsQueue
    from resilient_ckpt.async_ckpt.state_dict_saver import CheckpointMetadataCache

    directory = tempfile.mkdtemp(prefix="rc_call_graph_")
    store = os.path.join(directory, "store")
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=0, world_size=1, timeout=timedelta(seconds=120)
    )
    state = {f"layer{i}.weight": torch.randn(256) for i in range(args.tensors)}
    queue = AsyncCallsQueue(persistent=True)
    cache = CheckpointMetadataCache()
    try:
        for step in range(args.warmups):
            _save(state, directory, step, queue, cache)
        trace.on = True
        _save(state, directory, args.warmups, queue, cache)
        trace.on = False
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        queue.close()
        dist.destroy_process_group()

    total = sum(trace.crossings.values())
    print(f"steady async DCP save, 1 rank, {args.tensors} tensors")
    print(f"  our modules that ran:         {len(trace.modules)}")
    print(f"  calls between our modules:    {total}")
    print("  busiest pairs (caller -> callee: calls):")
    for (caller, callee), n in trace.crossings.most_common(args.top):
        short = lambda name: name.removeprefix(PACKAGE + ".")  # noqa: E731
        print(f"    {short(caller)} -> {short(callee)}: {n}")
    print("  modules: " + ", ".join(sorted(m.removeprefix(PACKAGE + ".") for m in trace.modules)))


if __name__ == "__main__":
    main()
