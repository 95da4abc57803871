"""``PersistentAsyncCaller``: one spawned worker process per queue, reused for every save.

Trainer side of the protocol in :mod:`._messages`. Scheduling stages the request into a
shared-memory arena (:mod:`._staging`), attaches the arena to the worker once, and sends a
``Submit``. Results are drained without blocking; a worker that dies is noticed by its
process sentinel or by EOF on the connection, and every call in flight then fails with a
:class:`WorkerDiedError` naming the rank and the exit code. The next request starts a fresh
worker.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
from collections import OrderedDict
from multiprocessing.connection import wait
from typing import Any

from .. import _dist
from .._logging import get_logger
from ..config import Timeouts, WorkerOptions
from ..errors import (
    CheckpointingException,
    CheckpointTimeoutError,
    WorkerDiedError,
)
from . import _worker
from ._callers import AsyncCaller, LocalStatus, exit_description, failure_error
from ._completion import State
from ._messages import AttachArena, Channel, Hello, Result, Shutdown, Submit
from ._request import AsyncRequest
from ._staging import ArenaPool, stage

logger = get_logger(__name__)

_MAIN_GUARD_HINT = (
    "If the trainer is a script, protect its entry point with `if __name__ == '__main__':` "
    "(the worker is started with the 'spawn' method, which re-imports the main module)."
)


class PersistentAsyncCaller(AsyncCaller):
    """A long-lived background worker process for one rank."""

    def __init__(
        self,
        is_daemon: bool = True,
        cpu_priority: int = 10,
        io_priority: int | None = None,
        sigterm_timeout: float = 30.0,
        cpu_shm_mode: bool = False,
        *,
        timeouts: Timeouts | None = None,
        max_staging_buffers: int = 2,
    ) -> None:
        super().__init__(timeouts)
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
        self._status: dict[int, LocalStatus] = {}
        self._attached: set[int] = set()
        self._pool = ArenaPool(max_staging_buffers)
        self.timings: dict[int, dict[str, float]] = {}

    # -- worker lifecycle -------------------------------------------------------------------

    def start(self, rank: int | None = None, wait_ready: bool = True) -> None:
        """Spawn the worker (if not running); optionally wait for its handshake."""
        if self.process is None:
            self.rank = rank if rank is not None else _dist.rank()
            ctx = mp.get_context("spawn")
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            level = logging.getLogger("resilient_ckpt").getEffectiveLevel()
            self.process = ctx.Process(
                target=_worker.main,
                args=(
                    child_conn,
                    os.getpid(),
                    self.rank,
                    level,
                    self.cpu_priority,
                    self.io_priority,
                ),
                daemon=self.is_daemon,
                name=f"resilient_ckpt-worker-{self.rank}",
            )
            self.start_time = time.monotonic()
            self.process.start()
            child_conn.close()
            self._channel = Channel(parent_conn)
            self._ready = False
            self._attached.clear()
            self._start_deadline = time.monotonic() + self.timeouts.worker_start
            logger.info("started checkpoint worker pid %s", self.process.pid)
        if wait_ready:
            self._handshake()

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
            f"{exit_description(code)}. {_MAIN_GUARD_HINT}",
            exitcode=code,
        )

    def _reap(self) -> None:
        """Forget a dead (or killed) worker; fail its in-flight calls; free the arenas."""
        proc = self.process
        if proc is None:
            return
        proc.join(1.0)
        if proc.exitcode is None:
            proc.kill()
            proc.join(self.timeouts.shutdown)
        code = proc.exitcode
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
        self.process = None
        self._ready = False

    # -- scheduling ---------------------------------------------------------------------------

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        self._drain()
        self.start(wait_ready=False)
        call_idx = async_req.call_idx
        started = time.perf_counter()
        staged = stage(
            (
                async_req.async_fn,
                tuple(async_req.async_fn_args),
                async_req.async_fn_kwargs,
                async_req.preload_fn,
            ),
            self._pool,
            self._wait_for_release,
            what=f"async request {call_idx}",
        )
        stage_s = time.perf_counter() - started
        try:
            self._handshake()
            channel = self._channel
            if channel is None:
                raise WorkerDiedError(f"rank {self.rank}: checkpoint worker is gone")
            arena_id = staged.arena.arena_id if staged.arena is not None else None
            if staged.arena is not None and arena_id not in self._attached:
                channel.send(
                    AttachArena(staged.arena.arena_id, staged.arena.nbytes),
                    fd=staged.arena.fd,
                    peer_pid=self._worker_pid,
                )
                self._attached.add(staged.arena.arena_id)
            channel.send(Submit(call_idx, arena_id, staged.slots, staged.payload))
        except CheckpointingException:
            # Ours already say what happened (note: CheckpointTimeoutError is an OSError).
            if staged.arena is not None:
                self._pool.release(staged.arena.arena_id)
            raise
        except OSError as exc:
            code = self.process.exitcode if self.process is not None else None
            self._reap()
            raise WorkerDiedError(
                f"rank {self.rank}: lost the checkpoint worker while submitting async request "
                f"{call_idx} ({exit_description(code)}): {exc}",
                exitcode=code,
                call_idx=call_idx,
                failed_ranks=(self.rank or 0,),
            ) from exc
        except BaseException:
            if staged.arena is not None:
                self._pool.release(staged.arena.arena_id)
            raise
        self._inflight[call_idx] = arena_id
        self._unfinalized.append(call_idx)
        self.timings[call_idx] = {"stage": stage_s, "bytes": float(staged.nbytes)}
        logger.debug("staged async request %d: %d bytes in %.4fs", call_idx, staged.nbytes, stage_s)

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

    def _drain(self) -> None:
        """Read every message that has arrived; notice a dead worker."""
        channel = self._channel
        if channel is None or not self._ready:
            if self.process is not None and self.process.exitcode is not None:
                self._reap()
            return
        try:
            while channel.poll(0):
                body = channel.recv()
                if isinstance(body, Result):
                    self._on_result(body)
        except (EOFError, OSError):
            self._reap()
            return
        if self.process is not None and self.process.exitcode is not None:
            self._reap()

    def local_status(self, call_idx: int) -> LocalStatus:
        self._drain()
        return self._status.get(call_idx, LocalStatus(State.RUNNING))

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
            wait([self._channel.conn, self.process.sentinel], remaining)

    def forget(self, call_idx: int) -> None:
        super().forget(call_idx)
        self._status.pop(call_idx, None)
        if len(self.timings) > 256:
            for old in sorted(self.timings)[:-128]:
                del self.timings[old]

    # -- shutdown -----------------------------------------------------------------------------

    def close(self, abort: bool = False) -> list[int]:
        """Stop the worker: drain (unless ``abort``), then SIGTERM, then SIGKILL."""
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
