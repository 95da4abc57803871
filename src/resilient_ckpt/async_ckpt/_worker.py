"""The persistent background worker process: its hygiene and its main loop.

The process side of :class:`._persistent.PersistentAsyncCaller`, whose module owns start-up,
handshake and reaping (and why not ``spawn``); the messages between them are
:mod:`._protocol`'s.

* **A fresh interpreter that runs this module, not the trainer's main module**: the trainer
  runs ``python -c`` :data:`BOOTSTRAP`, which takes the trainer's ``sys.path``, imports this
  module and calls :func:`main` with a :class:`~._protocol.Setup`. The main module is
  imported only by a request that needs it (:mod:`._main_module`).
* **Requests run in order, on the main thread.** A receiver thread reads messages (so the
  trainer's sends never block) and the main thread runs requests one at a time: unstage,
  ``preload_fn`` (its result replaces ``async_fn_args[1]``, as in NVRx), ``async_fn``, then a
  ``Result``. A running request may send ``Report`` values (:mod:`._reports`), each naming
  the request, on the same channel and before its ``Result``.
* **The trainer decides when the worker stops**: on ``Shutdown`` (after queued requests),
  connection close, or parent death. SIGINT is ignored: a Ctrl-C aimed at the trainer must
  not tear a write.
* **A worker never outlives its trainer**, by two mechanisms because each has a gap:
  ``PR_SET_PDEATHSIG`` (tied to the parent *thread* that started the child) and a watchdog
  comparing ``getppid()`` with the recorded pid (the parent may die before the signal is
  armed). The forked caller and the DCP write's child processes arm the same signal.
* **A worker yields to the trainer** (:func:`set_qos`).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from .. import _logging, _telemetry
from .._logging import get_logger
from . import _reports
from ._arena import Arena
from ._main_module import set_main_description
from ._protocol import (
    AttachArena,
    Channel,
    DetachArena,
    Hello,
    ProtocolError,
    RemoteFailure,
    Report,
    Result,
    Setup,
    Shutdown,
    Submit,
    widen_send_buffer,
)
from ._staging import unstage

logger = get_logger(__name__)

# -- process hygiene ------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1


def arm_parent_death_signal(parent_pid: int) -> None:
    """Kill this process when its parent dies; exit now if the parent is already gone."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the watchdog alone has to do
        pass
    if os.getppid() != parent_pid:
        os._exit(70)


def start_parent_watchdog(parent_pid: int, interval: float = 0.5) -> threading.Thread:
    """A daemon thread that exits the process once ``parent_pid`` is no longer its parent."""

    def _watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(71)
            time.sleep(interval)

    thread = threading.Thread(target=_watch, name="resilient_ckpt-parent-watchdog", daemon=True)
    thread.start()
    return thread


def set_qos(cpu_priority: int | None, io_priority: int | None) -> None:
    """Lower this process's CPU and I/O priority; never fatal.

    ``cpu_priority`` also moves the process to ``SCHED_BATCH``: under the default policy a
    worker woken by a request may preempt the trainer on its core while the trainer is still in
    its save call, lengthening the stall where cores are fewer than processes. A batch process
    is never favoured at wake-up; its throughput is unchanged.
    """
    if cpu_priority is not None and 0 <= cpu_priority <= 19:
        _batch_scheduling()
        try:
            current = os.nice(0)
            if cpu_priority > current:
                os.nice(cpu_priority - current)
        except OSError as exc:
            logger.warning("could not set nice %s: %s", cpu_priority, exc)
    if io_priority is not None:
        try:
            import psutil

            psutil.Process().ionice(int(io_priority))
        except (OSError, ValueError, ImportError, AttributeError) as exc:
            logger.warning("could not set ionice class %s: %s", io_priority, exc)


def _batch_scheduling() -> None:
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is None:  # not Linux
        return
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))
    except OSError as exc:
        logger.warning("could not set the SCHED_BATCH policy: %s", exc)


# -- the worker process ---------------------------------------------------------------------

_STOP = object()


def _receive_loop(channel: Channel, arenas: dict[int, Any], work: queue.Queue) -> None:
    while True:
        try:
            body = channel.recv()
        except (EOFError, OSError):
            # The trainer closed its end or died: nothing left to write for.
            _telemetry.shutdown_worker(1.0)
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
            with _telemetry.worker_write():
                async_fn(*args, **(kwargs or {}))
        timings["write"] = time.perf_counter() - start
        del async_fn, args, kwargs, preload_fn
        return Result(submit.call_idx, None, timings)
    except BaseException as exc:
        return Result(submit.call_idx, RemoteFailure.from_exception(exc), timings)


# What the trainer runs with ``python -c <BOOTSTRAP> <fd>``: the trainer's sys.path before
# any import of the library (empty entries, the ``-c`` program's current directory, dropped
# first so that a file of the user's cannot shadow a standard module imported here).
BOOTSTRAP = (
    "import sys; sys.path[:] = [p for p in sys.path if p]; "
    "from multiprocessing.connection import Connection; "
    "conn = Connection(int(sys.argv[1])); sys.path[:] = conn.recv(); "
    f"from {__name__} import main; main(conn)"
)

_in_worker = False


def in_worker() -> bool:
    """Whether this process is a checkpoint worker. It starts no worker of its own: one would mean
    it imported a main script that starts checkpointing when imported.
    """
    return _in_worker


def main(conn: Connection) -> None:
    """Entry point of the worker process (called by :data:`BOOTSTRAP`)."""
    global _in_worker
    _in_worker = True
    channel = Channel(conn)
    setup = channel.recv()
    if not isinstance(setup, Setup):
        raise ProtocolError(f"expected Setup first, got {type(setup).__name__}")
    arm_parent_death_signal(setup.parent_pid)
    start_parent_watchdog(setup.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _apply(setup)
    _telemetry.setup_worker(setup.otel_bootstrap, setup.rank)
    set_qos(setup.cpu_priority, setup.io_priority)

    widen_send_buffer(conn)  # a report (a rank's write results) is sent while writing
    running: list[int] = [-1]  # the request being run: its reports name it
    _reports.set_sink(lambda key, value: channel.send(Report(running[0], key, value)))
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
    _serve(channel, arenas, work, running)
    _telemetry.shutdown_worker()
    channel.close()


def _apply(setup: Setup) -> None:
    """What a spawned worker would have inherited: argv, process name, daemon flag, authentication
    key, and the package's log level.
    """
    sys.argv[:] = setup.argv
    process = multiprocessing.current_process()
    process.name = setup.name
    process.daemon = setup.is_daemon
    process.authkey = setup.authkey
    set_main_description(setup.main_module)
    _logging.set_worker_identity(setup.rank)
    package_logger = logging.getLogger("resilient_ckpt")
    package_logger.setLevel(setup.log_level)
    if not package_logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        package_logger.addHandler(handler)


def _serve(channel: Channel, arenas: dict[int, Any], work: queue.Queue, running: list[int]) -> None:
    """The main thread: run the requests in order until ``Shutdown`` (``running[0]``: the
    request being run)."""
    while True:
        item = work.get()
        if item is _STOP:
            return
        if isinstance(item, DetachArena):
            arena = arenas.pop(item.arena_id, None)
            if arena is not None:
                arena.close()
            continue
        running[0] = item.call_idx
        with _telemetry.worker_request(item.call_idx, item.traceparent) as span:
            result = _execute(item, arenas)
            if result.failure is not None:
                _telemetry.fail_request(span, result.failure.exc_type, result.failure.message)
        try:
            channel.send(result)
        except (BrokenPipeError, OSError):
            os._exit(0)
        # After replying: the trainer (blocked in finalize) must not wait for it; the
        # request's objects are already gone. Then everything still alive (modules, caches)
        # is frozen out of later collections: a full collection over torch's objects holds
        # the GIL long enough that the receiver thread could not read the next request
        # meanwhile, and a trainer sending one larger than the socket buffer (the write
        # items of thousands of tensors) would block in send until it ended.
        gc.collect()
        gc.freeze()
