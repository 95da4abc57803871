"""The persistent background worker: its typed messages, its process hygiene, its main loop.

The process side of :class:`._persistent.PersistentAsyncCaller`, whose module owns start-up,
handshake and reaping (and why not ``spawn``).

* **Typed messages over one connection** (a Unix socket pair): each message is one of the
  frozen dataclasses below, sent as ``(Kind, body)``; the receiver checks the kind against
  the body's type, so a protocol mix-up fails loudly. A worker exception travels back as a
  :class:`RemoteFailure` value (which always pickles) and is re-raised as the cause. Arena
  file descriptors follow :class:`AttachArena` out of band (``SCM_RIGHTS``), never pickled.
* **A fresh interpreter that runs this module, not the trainer's main module**: the trainer
  runs ``python -c`` :data:`BOOTSTRAP`, which takes the trainer's ``sys.path``, imports this
  module and calls :func:`main` with a :class:`Setup`. The main module is imported only by
  a request that needs it (see the section on the main module below).
* **Requests run in order, on the main thread.** A receiver thread reads messages (so the
  trainer's sends never block) and the main thread runs requests one at a time: unstage,
  ``preload_fn`` (its result replaces ``async_fn_args[1]``, as in NVRx), ``async_fn``, then a
  :class:`Result`. A running request may send :class:`Report` values (:mod:`._reports`).
* **The trainer decides when the worker stops**: on ``Shutdown`` (after queued requests),
  connection close, or parent death. SIGINT is ignored: a Ctrl-C aimed at the trainer must
  not tear a write.
* **A worker never outlives its trainer**, by two mechanisms because each has a gap:
  ``PR_SET_PDEATHSIG`` (tied to the parent *thread* that started the child) and a watchdog
  comparing ``getppid()`` with the recorded pid (the parent may die before the signal is
  armed). The forked caller and the DCP write's child processes arm the same signal.
* **A worker yields to the trainer** (:func:`set_qos`).

Conversation::

    trainer -> worker    sys.path         once, to the bootstrap (a plain list of strings)
    trainer -> worker    Setup            once, before anything else of the protocol
    worker  -> trainer   Hello            once, after start-up (the handshake)
    trainer -> worker    AttachArena+fd   once per staging arena the worker has not seen
    trainer -> worker    Submit           one per request, in call order
    worker  -> trainer   Report           any number, while a request runs
    worker  -> trainer   Result           one per Submit, in the same order
    trainer -> worker    DetachArena      when the trainer frees an arena
    trainer -> worker    Shutdown         orderly exit after the queued requests
"""

from __future__ import annotations

import array
import ctypes
import enum
import gc
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import runpy
import signal
import socket
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, ClassVar

from .. import _logging, _telemetry
from .._logging import get_logger
from ..errors import CheckpointingException, MainModuleError
from . import _reports

logger = get_logger(__name__)

# -- messages -------------------------------------------------------------------------------


class Kind(enum.Enum):
    SETUP = "setup"
    HELLO = "hello"
    ATTACH_ARENA = "attach_arena"
    DETACH_ARENA = "detach_arena"
    SUBMIT = "submit"
    RESULT = "result"
    REPORT = "report"
    SHUTDOWN = "shutdown"


@dataclass(frozen=True)
class Setup:
    """How the worker runs: what a spawned process would inherit besides its environment
    (``is_daemon`` as ``multiprocessing``'s flag: a daemon process starts no children)."""

    KIND: ClassVar[Kind] = Kind.SETUP
    parent_pid: int
    rank: int | None
    log_level: int
    cpu_priority: int | None
    io_priority: int | None
    is_daemon: bool
    name: str
    argv: tuple[str, ...]
    main_module: MainModule
    # The trainer's multiprocessing key: a manager's proxy in a request connects with it.
    authkey: bytes
    # NVRx's ``otel_bootstrap``: how the worker configures its telemetry (:mod:`.._telemetry`).
    otel_bootstrap: dict[str, Any] | None = None


@dataclass(frozen=True)
class Hello:
    KIND: ClassVar[Kind] = Kind.HELLO
    pid: int


@dataclass(frozen=True)
class AttachArena:
    KIND: ClassVar[Kind] = Kind.ATTACH_ARENA
    arena_id: int
    nbytes: int


@dataclass(frozen=True)
class DetachArena:
    KIND: ClassVar[Kind] = Kind.DETACH_ARENA
    arena_id: int


# Where one staged storage lies inside an arena: (offset, nbytes). A plain tuple, not a
# dataclass: a request has one per storage (thousands), and the C pickler writes plain
# tuples of ints without a Python call each.
Slot = tuple[int, int]


def _unpack_slots(packed: bytes) -> tuple[Slot, ...]:
    words = array.array("q")
    words.frombytes(packed)
    return tuple(zip(words[0::2], words[1::2], strict=True))


class SlotTable(tuple[Slot, ...]):
    """A request's slots, pickled as one packed bytes object (two int64 per slot), not thousands of
    small tuples to visit while the trainer waits. A steady-state save resends the table of its
    full staging, so it is packed once. The worker gets a plain tuple back.
    """

    _packed: bytes | None = None

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        packed = self._packed
        if packed is None:
            packed = array.array("q", itertools.chain.from_iterable(self)).tobytes()
            self._packed = packed
        return _unpack_slots, (packed,)


@dataclass(frozen=True)
class Submit:
    KIND: ClassVar[Kind] = Kind.SUBMIT
    call_idx: int
    arena_id: int | None
    slots: tuple[Slot, ...]
    payload: bytes
    # The trainer's save span (W3C ``traceparent``): the worker's spans are its children.
    traceparent: str | None = None


@dataclass(frozen=True)
class RemoteFailure:
    """An exception raised in the worker, as a value that always pickles."""

    exc_type: str
    message: str
    traceback: str

    @classmethod
    def from_exception(cls, exc: BaseException) -> RemoteFailure:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc), text)


@dataclass(frozen=True)
class Result:
    KIND: ClassVar[Kind] = Kind.RESULT
    call_idx: int
    failure: RemoteFailure | None = None
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Report:
    """A value the running request posted for the trainer (:func:`._reports.post`)."""

    KIND: ClassVar[Kind] = Kind.REPORT
    key: str
    value: Any


@dataclass(frozen=True)
class Shutdown:
    KIND: ClassVar[Kind] = Kind.SHUTDOWN


Body = Setup | Hello | AttachArena | DetachArena | Submit | Result | Report | Shutdown


class ProtocolError(CheckpointingException):
    """A message arrived that the protocol does not allow at this point."""


# A request's payload for thousands of tensors can exceed the socket's default send buffer;
# the send would then wait for the worker to be scheduled and drain it.
_SEND_BUFFER = 4 << 20


def receive_available(conn: Any, other: Callable[[Any], None]) -> None:
    """Read, without blocking, every message that has arrived on ``conn``: reports into the
    trainer's inbox (:mod:`._reports`), any other message to ``other``. Raises
    ``EOFError``/``OSError`` once the connection is lost.
    """
    while conn.poll(0):
        message = conn.recv()
        if isinstance(message, Report):
            _reports.deliver(message.key, message.value)
        else:
            other(message)


def widen_send_buffer(conn: Connection) -> None:
    """Let ``conn`` queue a whole payload without waiting for its reader (capped by the kernel at
    ``net.core.wmem_max``); best effort.
    """
    try:
        sock = socket.socket(fileno=os.dup(conn.fileno()))
    except OSError:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER)
    except OSError as exc:
        logger.debug("could not widen the worker channel's send buffer: %r", exc)
    finally:
        sock.close()


class Channel:
    """One end of the trainer/worker connection; sends are serialised by a lock."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._send_lock = threading.Lock()

    def send(self, body: Body, fd: int | None = None, peer_pid: int | None = None) -> None:
        from multiprocessing.reduction import send_handle

        with self._send_lock:
            self.conn.send((body.KIND, body))
            if fd is not None:
                send_handle(self.conn, fd, peer_pid or 0)

    def recv(self) -> Body:
        kind, body = self.conn.recv()
        if not isinstance(kind, Kind) or getattr(type(body), "KIND", None) is not kind:
            raise ProtocolError(f"malformed message: kind={kind!r}, body={type(body).__name__}")
        return body  # type: ignore[no-any-return]

    def recv_fd(self) -> int:
        from multiprocessing.reduction import recv_handle

        return recv_handle(self.conn)

    def poll(self, timeout: float = 0.0) -> bool:
        return self.conn.poll(timeout)

    def close(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass


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
    from ._arena import Arena

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
    _reports.set_sink(lambda key, value: channel.send(Report(key, value)))
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
    _serve(channel, arenas, work)
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


def _serve(channel: Channel, arenas: dict[int, Any], work: queue.Queue) -> None:
    """The main thread: run the requests in order until ``Shutdown``."""
    while True:
        item = work.get()
        if item is _STOP:
            return
        if isinstance(item, DetachArena):
            arena = arenas.pop(item.arena_id, None)
            if arena is not None:
                arena.close()
            continue
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


# -- the trainer's main module, imported on demand ---------------------------------------------
#
# Decision: this worker does not import the trainer's main module when it starts.
# ``multiprocessing``'s ``spawn`` does: it runs the main script again under the name
# ``__mp_main__``, so a script without an ``if __name__ == "__main__":`` guard runs its
# training a second time inside the worker, which dies (NVRx and ``dcp.async_save`` share the
# trap). Most requests never need that module: ``torch.save``, the DCP writer and the local
# checkpoints are the library's functions, and a user's own functions usually live in
# importable modules. A plain script, ``python -c`` and a notebook cell therefore all work.
#
# A request that does name a function or class of ``__main__`` gets it as spawn would have
# given it, but only then: the unpickler of :func:`._staging.unstage`
# (:class:`MainAwareUnpickler`) asks :func:`find_in_main`, which imports the main module once,
# as the trainer described it at start (:func:`describe_main`: its import name when run with
# ``python -m``, else its file), under the name ``__mp_main__`` (so its guarded block does not
# run), and installs it as ``__main__`` and ``__mp_main__``. A trainer that was itself started
# by spawn pickles its main module's functions as ``__mp_main__.<name>``: the same module.
#
# When that cannot work the request fails with :class:`~resilient_ckpt.errors.MainModuleError`
# naming the function and what to do:
#
# * the main module has no file to import (``python -c``, a notebook, an interactive
#   session), or it is a package's ``__main__`` (``python -m pkg``), which spawn does not run
#   again either: it is the program itself;
# * importing it failed (an unguarded script that starts checkpointing when imported fails
#   this way, see :func:`in_worker`). The failure is kept: the script is not run a second
#   time for the next request;
# * it imported, but has no such name at module level (defined under the guard).

_MAIN_NAMES = frozenset({"__main__", "__mp_main__"})


@dataclass(frozen=True)
class MainModule:
    """The trainer's main module: its import name (``python -m pkg.mod``), its file
    (``python script.py``), or neither (``python -c``, a notebook).
    """

    name: str | None = None
    path: str | None = None

    def source(self) -> str:
        if self.name is not None:
            return f"module {self.name}"
        return f"script {self.path}"


def describe_main() -> MainModule:
    """Trainer side: this process's main module, as spawn would record it."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if isinstance(name, str):
        return MainModule(name=name)
    path = getattr(main, "__file__", None)
    if isinstance(path, str):
        return MainModule(path=os.path.abspath(path))
    return MainModule()


# Worker side: what the trainer described, and the outcome of importing it (once).
_described: MainModule | None = None
_module: types.ModuleType | None = None
_import_error: BaseException | None = None


def set_main_description(main: MainModule) -> None:
    """Worker side, at start-up: the trainer's main module, imported by :func:`find_in_main`."""
    global _described
    _described = main


def find_in_main(qualname: str) -> Any:
    """Worker side: the trainer's ``__main__.<qualname>``, importing its main module on first use;
    :class:`MainModuleError` naming it when that cannot work.
    """
    main = _described or MainModule()
    module = _import_once(main, qualname)
    obj: Any = module
    try:
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except AttributeError as exc:
        raise _error(
            qualname,
            f"the trainer's main {main.source()}, imported (as __mp_main__, so its `if "
            f"__name__ == '__main__':` block did not run), defines no {qualname} at module "
            "level. Define it at module level, or",
        ) from exc
    return obj


def _import_once(main: MainModule, qualname: str) -> types.ModuleType:
    global _module, _import_error
    if _module is not None:
        return _module
    if main.path is None and (main.name is None or _is_package_main(main.name)):
        raise _error(qualname, _unavailable(main))
    if _import_error is None:
        try:
            _module = _run_main(main)
            return _module
        except BaseException as exc:  # SystemExit too: a script's argument parsing
            _import_error = exc
    raise _error(
        qualname,
        f"importing the trainer's main {main.source()} (as __mp_main__) failed with "
        f"{type(_import_error).__name__}: {_import_error}. Guard the script's entry point "
        "with `if __name__ == '__main__':`, so that importing it only defines things, or",
    ) from _import_error


def _is_package_main(name: str) -> bool:
    return name == "__main__" or name.endswith(".__main__")


def _unavailable(main: MainModule) -> str:
    if main.name is not None:
        return (
            f"the trainer's main module is the package entry point {main.name}, which is the "
            "program itself and is not imported again. Instead,"
        )
    return (
        "the trainer's main module has no file to import (a `python -c` program, an "
        "interactive session or a notebook). Instead,"
    )


def _error(qualname: str, why: str) -> MainModuleError:
    return MainModuleError(
        f"the async request refers to __main__.{qualname}, which the checkpoint worker "
        f"cannot import: {why} move {qualname} into an importable module (a .py file on "
        "sys.path) and import it from there",
        qualname=qualname,
    )


def _run_main(main: MainModule) -> types.ModuleType:
    """Import the main module as spawn does: run it under the name ``__mp_main__``."""
    if main.name is not None:
        namespace = runpy.run_module(main.name, run_name="__mp_main__", alter_sys=True)
    else:
        namespace = runpy.run_path(str(main.path), run_name="__mp_main__")
    module = types.ModuleType("__mp_main__")
    module.__dict__.update(namespace)
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module
    return module


class MainAwareUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that finds the trainer's ``__main__`` names through :func:`find_in_main`
    (in a worker; elsewhere the plain unpickler).
    """

    def find_class(self, module: str, name: str) -> Any:
        if module in _MAIN_NAMES and _described is not None:
            return find_in_main(name)
        return super().find_class(module, name)
