"""``PersistentAsyncCaller``: one background worker process per queue, reused for every save.

The trainer side of the protocol in :mod:`._protocol`: the process, its connection, and the
requests in flight.

* **Start**: a new interpreter (``subprocess``) running :mod:`._worker`'s bootstrap, at
  warm-up or on the first request, with this interpreter's options, standard streams (stdin
  excepted) and environment; its end of a socket pair goes by ``pass_fds``, then
  ``sys.path`` and the :class:`~._protocol.Setup` over it. Not ``multiprocessing``'s
  ``spawn``: spawn imports the trainer's main module into the child, so an unguarded script,
  a ``python -c`` program or a notebook cell ran its training again in the worker, and it
  has no public switch to skip that (the main module is imported on demand, see
  :mod:`._main_module`).
* **Handshake**: the worker is used once its ``Hello`` arrives within
  ``timeouts.worker_start``; one that exits first is reported with its exit code.
* **Scheduling** stages the request into an arena (:mod:`._staging`), attaches the arena to
  the worker once, and sends a ``Submit``.
* **Results and reports** come on the one channel, read by one receiver thread per worker
  that blocks on it (and on the worker's sentinel) and files them in the caller's
  :class:`~._reports.Mailbox`, under one condition: a ``Report`` into its call's
  :class:`~._reports.Reports`, where a thread waiting for it wakes at once, a ``Result``
  among the outcomes. The trainer thread alone applies the outcomes to the caller's state
  (it waits on the same condition), so nothing else needs a lock.
* **A dead worker** is noticed by the receiver (its sentinel, or EOF on the connection,
  once everything it sent has been read) and reaped by the trainer thread: every
  call in flight fails with :class:`WorkerDiedError` naming the rank and exit code, its
  arenas are freed, and the next request starts a fresh worker.
* **Shutdown escalates**: ``Shutdown`` after the queued requests (unless aborting), then
  SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from multiprocessing.connection import wait
from typing import Any

import torch

from .. import _dist, _telemetry
from .._logging import get_logger
from ..config import Timeouts, WorkerOptions
from ..errors import (
    CheckpointingException,
    CheckpointTimeoutError,
    ConfigurationError,
    InvalidRequestError,
    WorkerDiedError,
)
from . import _main_module, _reports, _worker
from ._arena import Arena, ArenaPool
from ._callers import (
    RUNNING,
    AsyncCaller,
    AsyncRequest,
    LocalStatus,
    State,
    exit_description,
    failure_error,
)
from ._copy import DeviceOrder, check_copy_threads, make_side_streams, warm_threads
from ._protocol import (
    AttachArena,
    Channel,
    DetachArena,
    Hello,
    Report,
    Result,
    Setup,
    Shutdown,
    Submit,
    widen_send_buffer,
)
from ._staging import (
    PendingSnapshot,
    PlanStep,
    StagedRequest,
    prime,
    request_sources,
    stage,
)
from ._structure import StageCache

logger = get_logger(__name__)


def _receive(channel: Channel, sentinel: int, mailbox: _reports.Mailbox, rank: int | None) -> None:
    """The receiver thread: file every message of the worker in ``mailbox`` until the channel
    closes or the worker exits (after everything it sent has been read)."""
    try:
        while channel.conn in wait([channel.conn, sentinel]):  # readable: a message or EOF
            body = channel.recv()
            if isinstance(body, Report):
                mailbox.report(body.call_idx, body.key, body.value)
            elif isinstance(body, Result):
                mailbox.outcome(body.call_idx, body)
            else:
                logger.error("rank %s: the checkpoint worker sent %s", rank, type(body).__name__)
                break
    except (EOFError, OSError):
        pass
    except Exception as exc:  # a report the trainer cannot unpickle, a protocol error
        logger.error("rank %s: lost the checkpoint worker's channel: %r", rank, exc)
    finally:
        mailbox.close()


class WorkerProcess:
    """The worker's process, with ``multiprocessing.Process``'s names for what the caller uses
    (``sentinel``: readable once the process has exited).
    """

    def __init__(self, popen: subprocess.Popen, sentinel: int) -> None:
        self._popen = popen
        self.pid = popen.pid
        self.sentinel = sentinel

    @property
    def exitcode(self) -> int | None:
        """None while running; else the exit status, ``-N`` when killed by signal ``N``."""
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        self._popen.terminate()  # a no-op once the process is reaped: never another pid

    def kill(self) -> None:
        self._popen.kill()

    def close(self) -> None:
        """Release the sentinel (once the caller has forgotten the process)."""
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


def _interpreter_options() -> list[str]:
    """This interpreter's options that a new one should share, as spawn passes them."""
    options = ["-O"] * sys.flags.optimize
    options += [opt for flag, opt in _FLAG_OPTIONS if getattr(sys.flags, flag, False)]
    options += [f"-W{option}" for option in sys.warnoptions]
    for key, value in sys._xoptions.items():  # documented in `sys`, despite the underscore
        options.append(f"-X{key}" if value is True else f"-X{key}={value}")
    return options


_FLAG_OPTIONS = (
    ("dont_write_bytecode", "-B"),
    ("ignore_environment", "-E"),
    ("no_user_site", "-s"),
    ("no_site", "-S"),
    ("isolated", "-I"),
    ("safe_path", "-P"),
)


def _launch(setup: Setup) -> tuple[WorkerProcess, Channel]:
    """Start a worker interpreter running :data:`._worker.BOOTSTRAP`; send it ``sys.path`` and
    ``setup``.
    """
    if not sys.executable:
        raise ConfigurationError(
            "cannot start the checkpoint worker: sys.executable is empty (an embedded "
            "interpreter); use AsyncCallsQueue(persistent=False)"
        )
    parent_conn, child_conn = mp.Pipe(duplex=True)
    widen_send_buffer(parent_conn)
    sentinel, child_end = os.pipe()  # EOF once the worker is gone (it holds child_end)
    try:
        popen = subprocess.Popen(
            [
                sys.executable,
                *_interpreter_options(),
                "-c",
                _worker.BOOTSTRAP,
                str(child_conn.fileno()),
            ],
            stdin=subprocess.DEVNULL,
            pass_fds=(child_conn.fileno(), child_end),
        )
    except BaseException:
        parent_conn.close()
        os.close(sentinel)
        raise
    finally:
        child_conn.close()
        os.close(child_end)
    channel = Channel(parent_conn)
    try:
        parent_conn.send(list(sys.path))  # read by the bootstrap: plain strings
        channel.send(setup)
    except OSError as exc:  # it died at once: the handshake reports its exit code
        logger.debug("could not send the checkpoint worker its setup: %r", exc)
    return WorkerProcess(popen, sentinel), channel


def _complete_and_stage(
    request: tuple, *args: Any, order: DeviceOrder | None = None, **kwargs: Any
) -> StagedRequest:
    """Run the request's deferred planning if it has one (a :class:`PlanStep` as its
    ``preload_fn``), then stage the planned request: here, so that in overlapped staging both
    run on the staging thread.
    """
    if order is not None:
        order.adopt()
    async_fn, fn_args, fn_kwargs, preload_fn = request
    if isinstance(preload_fn, PlanStep):
        fn_args, preload_fn = preload_fn.planned(fn_args)
        request = (async_fn, fn_args, fn_kwargs, preload_fn)
    return stage(request, *args, order=order, sources=request_sources(request), **kwargs)


def _no_wait() -> bool:
    return False


class PersistentAsyncCaller(AsyncCaller):
    """A long-lived background worker process for one rank."""

    def __init__(
        self,
        is_daemon: bool = True,
        cpu_priority: int | None = 10,
        io_priority: int | None = None,
        sigterm_timeout: float = 30.0,
        cpu_shm_mode: bool = False,
        otel_bootstrap: dict[str, Any] | None = None,
        *,
        timeouts: Timeouts | None = None,
        max_staging_buffers: int = 2,
        copy_threads: int | None = None,
    ) -> None:
        super().__init__(timeouts)
        # NVRx's keyword: how the worker sets up its telemetry, fixed when it starts.
        self.otel_bootstrap = _telemetry.check_bootstrap(otel_bootstrap)
        self.copy_threads = check_copy_threads(copy_threads)
        self._snapshot: PendingSnapshot | None = None
        options = WorkerOptions(is_daemon, cpu_priority, io_priority, sigterm_timeout, cpu_shm_mode)
        self.is_daemon = options.is_daemon
        self.cpu_priority = options.cpu_priority
        self.io_priority = options.io_priority
        self.sigterm_timeout = float(options.sigterm_timeout)
        # The worker never touches CUDA (the trainer stages), so this only records intent.
        self.cpu_shm_mode = cpu_shm_mode
        self.process: Any = None
        self._channel: Channel | None = None
        self._worker_pid: int | None = None
        self._start_deadline = 0.0
        self._ready = False
        self._inflight: OrderedDict[int, int | None] = OrderedDict()
        self._mailbox = _reports.Mailbox()
        self._receiver: threading.Thread | None = None
        self._status: dict[int, LocalStatus] = {}
        self._attached: set[int] = set()
        self._pool = ArenaPool(max_staging_buffers)
        # The previous request's layout: a save of the same structure reuses it.
        self.stage_cache = StageCache()
        self.timings: dict[int, dict[str, float]] = {}

    # -- worker lifecycle -------------------------------------------------------------------

    def start(self, rank: int | None = None, wait_ready: bool = True) -> None:
        """Start the worker (if not running); optionally wait for its handshake."""
        if self.process is None:
            if _worker.in_worker():
                raise InvalidRequestError(
                    "a checkpoint worker cannot start a checkpoint worker of its own: the "
                    "worker is running the trainer's main script (a request needs one of its "
                    "functions) and the script starts checkpointing when it is imported"
                )
            self.rank = rank if rank is not None else _dist.rank()
            self.start_time = time.monotonic()
            self.process, self._channel = _launch(
                Setup(
                    parent_pid=os.getpid(),
                    rank=self.rank,
                    log_level=logging.getLogger("resilient_ckpt").getEffectiveLevel(),
                    cpu_priority=self.cpu_priority,
                    io_priority=self.io_priority,
                    is_daemon=self.is_daemon,
                    name=f"resilient_ckpt-worker-{self.rank}",
                    argv=tuple(sys.argv),
                    main_module=_main_module.describe_main(),
                    authkey=bytes(mp.current_process().authkey),
                    otel_bootstrap=self.otel_bootstrap,
                )
            )
            self._ready = False
            self._attached.clear()
            self._start_deadline = time.monotonic() + self.timeouts.worker_start
            logger.info("started checkpoint worker pid %s", self.process.pid)
        if wait_ready:
            self._handshake()

    def _start_worker(self, rank: int) -> None:
        """NVRx name: start the worker for ``rank`` without waiting for its handshake."""
        self.start(rank=rank, wait_ready=False)

    def _handshake(self) -> None:
        if self._ready:
            return
        channel, proc = self._channel, self.process
        if channel is None or proc is None:
            raise WorkerDiedError("checkpoint worker is not running")
        remaining = self._start_deadline - time.monotonic()
        ready = wait([channel.conn, proc.sentinel], max(0.0, remaining))
        if channel.conn in ready:
            try:
                hello = channel.recv()
            except (EOFError, OSError):
                hello = None
            if isinstance(hello, Hello):
                self._worker_pid = hello.pid
                self._ready = True
                self._start_receiver(channel, proc.sentinel)
                logger.debug(
                    "worker pid %s ready after %.2fs",
                    hello.pid,
                    time.monotonic() - (self.start_time or 0.0),
                )
                return
        code = proc.exitcode
        self._reap()
        if code is None and not ready:
            raise CheckpointTimeoutError(
                f"rank {self.rank}: checkpoint worker did not start within "
                f"{self.timeouts.worker_start:.0f}s (RESILIENT_CKPT_WORKER_START_TIMEOUT)"
            )
        raise WorkerDiedError(
            f"rank {self.rank}: checkpoint worker exited during start-up with "
            f"{exit_description(code)}; its own error, if it printed one, is on this "
            "process's standard error",
            exitcode=code,
        )

    def _reap(self) -> None:
        """Forget a dead (or killed) worker; fail its in-flight calls (those whose result it
        sent settle as sent); free the arenas."""
        proc = self.process
        if proc is None:
            return
        proc.join(1.0)
        if proc.exitcode is None:
            proc.kill()
            proc.join(self.timeouts.shutdown)
        code = proc.exitcode
        self._stop_receiver()
        for result in self._mailbox.take_outcomes()[0]:
            self._on_result(result)
        for call_idx in list(self._inflight):
            if call_idx not in self._status:
                self._status[call_idx] = LocalStatus(
                    State.FAILED,
                    WorkerDiedError(
                        f"rank {self.rank}: checkpoint worker (pid {proc.pid}) died with "
                        f"{exit_description(code)} while async request {call_idx} was in flight",
                        exitcode=code,
                        call_idx=call_idx,
                        failed_ranks=(self.rank or 0,),
                    ),
                )
        self._inflight.clear()
        self._pool.release_all()
        self._attached.clear()
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        self._mailbox.close()
        proc.close()
        self.process = None
        self._ready = False

    # -- scheduling ---------------------------------------------------------------------------

    def schedule_async_call(
        self, async_req: AsyncRequest, *, overlap_staging: bool = False
    ) -> None:
        """Stage ``async_req`` and hand it to the worker.

        With ``overlap_staging`` the snapshot completes after this returns; the request reaches the
        worker at :meth:`wait_for_snapshot`, which every other method of this caller calls first,
        so it is never lost.
        """
        self._drain()  # settles a pending snapshot first
        self.start(wait_ready=False)
        call_idx = async_req.call_idx
        _telemetry.begin_save(self, call_idx)
        started = time.perf_counter()
        stage_request = functools.partial(
            _complete_and_stage,
            (
                async_req.async_fn,
                tuple(async_req.async_fn_args),
                async_req.async_fn_kwargs,
                async_req.preload_fn,
            ),
            self._pool,
            wait_for_release=self._wait_for_release,
            what=f"async request {call_idx}",
            threads=self.copy_threads,
            cache=self.stage_cache,
        )
        if overlap_staging:
            self._reserve_arena_room()
            # In the background nothing may wait for an arena (see _staging): there is room.
            order = DeviceOrder() if torch.cuda.is_initialized() else None
            background = functools.partial(stage_request, wait_for_release=_no_wait, order=order)
            self._inflight[call_idx] = None
            self._unfinalized.append(call_idx)
            self.timings[call_idx] = {"stage": 0.0, "bytes": 0.0}
            self._snapshot = PendingSnapshot(call_idx, background)
            return
        with _telemetry.phase(self, call_idx, _telemetry.STAGE_SPAN):
            staged = stage_request()
        stage_s = time.perf_counter() - started
        self._inflight[call_idx] = staged.arena.arena_id if staged.arena is not None else None
        self._unfinalized.append(call_idx)
        self.timings[call_idx] = {"stage": stage_s, "bytes": float(staged.nbytes)}
        self._submit(call_idx, staged)
        logger.debug("staged async request %d: %d bytes in %.4fs", call_idx, staged.nbytes, stage_s)

    def _reserve_arena_room(self) -> None:
        """Wait (here, in the trainer's thread) until the pool can hand out an arena."""
        while not self._pool.has_room():
            if not self._wait_for_release():
                raise CheckpointTimeoutError(
                    f"rank {self.rank}: all {self._pool.max_arenas} staging arenas stayed busy "
                    "past the deadline; earlier requests are still being written"
                )

    def wait_for_snapshot(self, timeout: float | None = None) -> None:
        """Block until the pending overlapped snapshot is complete, then submit it.

        Call it before anything changes the saved tensors (before ``optimizer.step()``).
        A no-op when no overlapped snapshot is pending.
        """
        pending, self._snapshot = self._snapshot, None
        if pending is None:
            return
        call_idx = pending.call_idx
        started = time.perf_counter()
        try:
            staged, staging_s = pending.wait(
                timeout if timeout is not None else self.timeouts.finalize
            )
        except BaseException as exc:
            # Failed here; finalizing the call reports it on every rank, as a worker's error.
            self._inflight.pop(call_idx, None)
            self._status[call_idx] = LocalStatus(State.FAILED, exc)
            pending.abandon(self._pool.release)
            raise
        timings = self.timings[call_idx]
        timings.update(
            snapshot_wait=time.perf_counter() - started, stage=staging_s, bytes=float(staged.nbytes)
        )
        self._inflight[call_idx] = staged.arena.arena_id if staged.arena is not None else None
        self._submit(call_idx, staged)

    def _settle_snapshot(self) -> None:
        """The implicit :meth:`wait_for_snapshot`: a failed snapshot becomes its call's failure,
        reported on every rank by finalize; raising here could leave this rank out of a collective
        the others entered.
        """
        if self._snapshot is None:
            return
        try:
            self.wait_for_snapshot()
        except Exception as exc:
            logger.error("rank %s: overlapped snapshot failed: %s", self.rank, exc)

    def _submit(self, call_idx: int, staged: StagedRequest) -> None:
        """Attach the arena (first use) and send the ``Submit``; undo on failure."""
        arena_id = staged.arena.arena_id if staged.arena is not None else None
        try:
            self._handshake()
            channel = self._channel
            if channel is None:
                raise WorkerDiedError(f"rank {self.rank}: checkpoint worker is gone")
            if staged.arena is not None:
                self._attach(channel, staged.arena)
            traceparent = _telemetry.traceparent(self, call_idx)
            channel.send(Submit(call_idx, arena_id, staged.slots, staged.payload, traceparent))
        except OSError as exc:
            if isinstance(exc, CheckpointingException):
                # Ours already say what happened (CheckpointTimeoutError is an OSError).
                self._unschedule(call_idx, arena_id)
                raise
            code = self.process.exitcode if self.process is not None else None
            self._unschedule(call_idx, arena_id)
            self._reap()
            raise WorkerDiedError(
                f"rank {self.rank}: lost the checkpoint worker while submitting async request "
                f"{call_idx} ({exit_description(code)}): {exc}",
                exitcode=code,
                call_idx=call_idx,
                failed_ranks=(self.rank or 0,),
            ) from exc
        except BaseException:
            self._unschedule(call_idx, arena_id)
            raise

    def _unschedule(self, call_idx: int, arena_id: int | None) -> None:
        self._inflight.pop(call_idx, None)
        if call_idx in self._unfinalized:
            self._unfinalized.remove(call_idx)
        if arena_id is not None:
            self._pool.release(arena_id)

    def warmup(self, state: Any = None, *, nbytes: int | None = None) -> None:
        """Start the worker and the copy threads, attach a pre-faulted arena sized for ``state`` (or
        ``nbytes``), and prime the staging cache, so the first save costs a steady one.
        """
        self._settle_snapshot()
        self.start(wait_ready=False)
        warm_threads(self.copy_threads)
        if torch.cuda.is_initialized():
            make_side_streams([torch.cuda.current_device()])
        size = 0
        tensors: list[torch.Tensor] = []
        if state is not None:
            sources = request_sources(state)
            size, tensors = prime(state, self.stage_cache, self.copy_threads, sources=sources)
        if nbytes is not None:
            size = nbytes
        self._handshake()
        if size <= 0:
            return
        arena = self._pool.acquire(size, self._wait_for_release)
        try:
            self.stage_cache.prepare(arena, tensors)
            if self._channel is not None:
                self._attach(self._channel, arena)
        finally:
            self._pool.release(arena.arena_id)

    def _attach(self, channel: Channel, arena: Arena) -> None:
        """Hand ``arena`` to the worker (once), and have it unmap the arenas the pool replaced."""
        for stale in self._attached - self._pool.live_ids():
            channel.send(DetachArena(stale))
            self._attached.discard(stale)
        if arena.arena_id not in self._attached:
            channel.send(
                AttachArena(arena.arena_id, arena.nbytes), fd=arena.fd, peer_pid=self._worker_pid
            )
            self._attached.add(arena.arena_id)

    def _wait_for_release(self) -> bool:
        """Block until some in-flight call settles (frees its arena); False on deadline."""
        if not self._inflight:
            return False
        oldest = next(iter(self._inflight))
        self.wait_local(oldest, self.timeouts.finalize)
        return oldest not in self._inflight

    # -- results ------------------------------------------------------------------------------

    def _on_result(self, result: Result) -> None:
        arena_id = self._inflight.pop(result.call_idx, None)
        if arena_id is not None:
            self._pool.release(arena_id)
        rank = self.rank or 0
        if result.failure is not None:
            self._status[result.call_idx] = LocalStatus(
                State.FAILED,
                failure_error(rank, result.call_idx, result.failure),
                dict(result.timings),
            )
        else:
            self._status[result.call_idx] = LocalStatus(State.DONE, None, dict(result.timings))
        self.timings.setdefault(result.call_idx, {}).update(result.timings)

    def _start_receiver(self, channel: Channel, sentinel: int) -> None:
        self._mailbox.reopen()
        self._receiver = threading.Thread(
            target=_receive,
            args=(channel, sentinel, self._mailbox, self.rank),
            name=f"resilient_ckpt-worker-receiver-{self.rank}",
            daemon=True,
        )
        self._receiver.start()

    def _stop_receiver(self) -> None:
        """End the receiver thread (the worker is gone or going): it reads end-of-file."""
        receiver, self._receiver = self._receiver, None
        if receiver is None:
            return
        if self._channel is not None:
            self._channel.shut()
        receiver.join(self.timeouts.shutdown)
        if receiver.is_alive():
            logger.warning("the checkpoint worker's receiver thread did not end")

    def reports_of(self, call_idx: int) -> _reports.Reports:
        return self._mailbox.reports_of(call_idx)

    def _drain(self) -> None:
        """Apply the results the receiver read; reap a dead worker."""
        self._settle_snapshot()
        if self._receiver is None:
            if self.process is not None and self.process.exitcode is not None:
                self._reap()
            return
        results, lost = self._mailbox.take_outcomes()
        for result in results:
            self._on_result(result)
        if lost:
            self._reap()

    def local_status(self, call_idx: int) -> LocalStatus:
        self._drain()
        return self._status.get(call_idx, RUNNING)

    def wait_local(self, call_idx: int, timeout: float) -> LocalStatus:
        deadline = time.monotonic() + timeout
        while True:
            status = self.local_status(call_idx)
            remaining = deadline - time.monotonic()
            if status.state != State.RUNNING or remaining <= 0:
                return status
            if self._channel is None or self.process is None:
                return status
            if not self._ready:
                self._handshake()
                continue
            self._mailbox.wait(remaining)

    def forget(self, call_idx: int) -> None:
        super().forget(call_idx)
        self._status.pop(call_idx, None)
        self._mailbox.forget(call_idx)
        if len(self.timings) > 256:
            for old in sorted(self.timings)[:-128]:
                del self.timings[old]

    # -- shutdown -----------------------------------------------------------------------------

    def close(self, abort: bool = False) -> list[int]:
        """Stop the worker: drain (unless ``abort``), then SIGTERM, then SIGKILL."""
        if self._snapshot is not None:
            if abort:
                pending, self._snapshot = self._snapshot, None
                pending.abandon(self._pool.release, self.timeouts.shutdown)
            else:
                self._settle_snapshot()
        dropped = [i for i in self._inflight if i not in self._status]
        proc = self.process
        if proc is not None:
            if not abort and self._channel is not None and proc.exitcode is None:
                try:
                    if not self._ready:
                        self._handshake()
                    self._channel.send(Shutdown())
                    deadline = time.monotonic() + self.timeouts.shutdown
                    while proc.exitcode is None and time.monotonic() < deadline:
                        self._drain()
                        if self.process is None:
                            break
                        wait([proc.sentinel], min(0.2, deadline - time.monotonic()))
                except (OSError, EOFError, WorkerDiedError, CheckpointTimeoutError) as exc:
                    logger.warning(
                        "checkpoint worker pid %s did not shut down cleanly (%s); stopping it",
                        proc.pid,
                        exc,
                    )
                dropped = [i for i in self._inflight if i not in self._status]
            if proc.exitcode is None:
                proc.terminate()
                proc.join(self.sigterm_timeout if not abort else min(self.sigterm_timeout, 5.0))
            if proc.exitcode is None:
                logger.warning("checkpoint worker pid %s ignored SIGTERM; killing it", proc.pid)
                proc.kill()
                proc.join(self.timeouts.shutdown)
            self._reap()
        for idx, status in self._status.items():
            self._log_dropped_failure(idx, status)
        for idx in dropped:
            self._status.pop(idx, None)
        self._unfinalized.clear()
        self._pool.close()
        if dropped:
            logger.warning("closed checkpoint worker with async request(s) %s unfinished", dropped)
        return dropped

    @property
    def staging_arenas_created(self) -> int:
        """How many shared-memory arenas this caller has allocated (for memory checks)."""
        return self._pool.created
