"""The persistent background worker: the process side of :class:`PersistentAsyncCaller`.

Runs in a process started with the ``spawn`` method. A receiver thread reads messages (so
the trainer's sends never block on a busy worker) and hands requests to the main thread,
which executes them one at a time, in order: unstage the arguments from the arena, run
``preload_fn`` (its result replaces ``async_fn_args[1]``, as in NVRx), run ``async_fn``,
reply with a :class:`Result` carrying either timings or the failure as a value.

The worker exits on ``Shutdown`` (after the queued requests), when the connection closes,
or when its parent dies. SIGINT is ignored: a Ctrl-C aimed at the trainer must not tear a
write; the trainer decides when the worker stops.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from .. import _logging
from ._messages import (
    AttachArena,
    Channel,
    DetachArena,
    Hello,
    RemoteFailure,
    Result,
    Shutdown,
    Submit,
)
from ._proc import arm_parent_death_signal, set_qos, start_parent_watchdog

_STOP = object()


def _receive_loop(channel: Channel, arenas: dict[int, Any], work: queue.Queue) -> None:
    from ._arena import Arena

    while True:
        try:
            body = channel.recv()
        except (EOFError, OSError):
            # The trainer closed its end or died: nothing left to write for.
            os._exit(0)
        if isinstance(body, AttachArena):
            fd = channel.recv_fd()
            arenas[body.arena_id] = Arena(body.nbytes, arena_id=body.arena_id, fd=fd)
        elif isinstance(body, DetachArena):
            work.put(body)
        elif isinstance(body, Submit):
            work.put(body)
        elif isinstance(body, Shutdown):
            work.put(_STOP)
            return


def _execute(submit: Submit, arenas: dict[int, Any]) -> Result:
    from ._staging import unstage

    timings: dict[str, float] = {}
    try:
        arena = arenas.get(submit.arena_id) if submit.arena_id is not None else None
        start = time.perf_counter()
        async_fn, args, kwargs, preload_fn = unstage(submit.payload, arena, submit.slots)
        args = list(args)
        if preload_fn is not None:
            replacement = preload_fn()
            if replacement is None:
                raise TypeError(
                    "preload_fn returned None; it must return the replacement for "
                    "async_fn_args[1] (the state dict to write)"
                )
            args[1] = replacement
        timings["preload"] = time.perf_counter() - start
        start = time.perf_counter()
        if async_fn is not None:
            async_fn(*args, **(kwargs or {}))
        timings["write"] = time.perf_counter() - start
        del async_fn, args, kwargs, preload_fn
        return Result(submit.call_idx, None, timings)
    except BaseException as exc:
        return Result(submit.call_idx, RemoteFailure.from_exception(exc), timings)


def main(
    conn: Connection,
    parent_pid: int,
    rank: int | None,
    log_level: int,
    cpu_priority: int | None,
    io_priority: int | None,
) -> None:
    """Entry point of the spawned worker process."""
    arm_parent_death_signal(parent_pid)
    start_parent_watchdog(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _logging.set_worker_identity(rank)
    package_logger = logging.getLogger("resilient_ckpt")
    package_logger.setLevel(log_level)
    if not package_logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        package_logger.addHandler(handler)
    set_qos(cpu_priority, io_priority)

    channel = Channel(conn)
    arenas: dict[int, Any] = {}
    work: queue.Queue = queue.Queue()
    channel.send(Hello(os.getpid()))
    receiver = threading.Thread(
        target=_receive_loop,
        args=(channel, arenas, work),
        name="resilient_ckpt-receiver",
        daemon=True,
    )
    receiver.start()
    gc.freeze()  # what start-up imported lives as long as the worker: never scan it
    while True:
        item = work.get()
        if item is _STOP:
            break
        if isinstance(item, DetachArena):
            arena = arenas.pop(item.arena_id, None)
            if arena is not None:
                arena.close()
            continue
        result = _execute(item, arenas)
        try:
            channel.send(result)
        except (BrokenPipeError, OSError):
            os._exit(0)
        # After replying: the trainer (blocked in finalize) must not wait for it; the
        # request's objects are already gone. Then everything still alive (modules, caches)
        # is frozen out of later collections: a full collection over torch's objects takes
        # ~0.1 s holding the GIL, so the receiver thread could not read the next request
        # meanwhile and a trainer sending one larger than the socket buffer (the write items
        # of thousands of tensors) would block in send until it ended.
        gc.collect()
        gc.freeze()
    channel.close()
