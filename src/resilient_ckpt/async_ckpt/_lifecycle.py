"""Starting, greeting and reaping the persistent worker process (trainer side).

Split from :mod:`._persistent` (which schedules and collects requests): this part only
knows the process, its connection and what must be failed or freed when it dies.
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
from ..config import Timeouts
from ..errors import CheckpointTimeoutError, WorkerDiedError
from . import _worker
from ._arena import ArenaPool
from ._callers import LocalStatus, State, exit_description
from ._worker import Channel, Hello, widen_send_buffer

logger = get_logger(__name__)

_MAIN_GUARD_HINT = (
    "If the trainer is a script, protect its entry point with `if __name__ == '__main__':` "
    "(the worker is started with the 'spawn' method, which re-imports the main module)."
)


class WorkerLifecycle:
    """Mixin of :class:`._persistent.PersistentAsyncCaller`: the worker process itself."""

    rank: int | None
    start_time: float | None
    timeouts: Timeouts
    is_daemon: bool
    cpu_priority: int | None
    io_priority: int | None
    process: Any
    _channel: Channel | None
    _worker_pid: int | None
    _start_deadline: float
    _ready: bool
    _inflight: OrderedDict[int, int | None]
    _status: dict[int, LocalStatus]
    _attached: set[int]
    _pool: ArenaPool

    # -- worker lifecycle -------------------------------------------------------------------

    def start(self, rank: int | None = None, wait_ready: bool = True) -> None:
        """Spawn the worker (if not running); optionally wait for its handshake."""
        if self.process is None:
            self.rank = rank if rank is not None else _dist.rank()
            ctx = mp.get_context("spawn")
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            widen_send_buffer(parent_conn)
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
