"""Run a function on N ranks (processes, gloo process group) with a deadline.

``launch(fn, world_size, *args, timeout=...)`` starts ``world_size`` processes, initialises
a gloo process group in each (rendezvous through a ``FileStore`` in a fresh temporary
directory, so no port is ever reserved or fixed), calls ``fn(rank, world_size, *args)``
and returns the per-rank results in rank order.

Failures are loud and bounded: an exception on any rank raises :class:`RankFailure` with
that rank's traceback; a rank still running at the deadline, or dying without reporting,
raises :class:`RankTimeout` / :class:`RankFailure` naming it, and every process is killed,
so a hung collective fails the test instead of stalling CI. ``fn`` must be importable (a
module-level function) because the children import it. Like ``torchrun``, each rank gets
one intra-op thread unless ``OMP_NUM_THREADS`` is set.

The ranks are started by ``multiprocessing``'s ``forkserver`` with torch and this package
preloaded: a rank is then a fork of a clean, single-threaded server process that has already
imported them, instead of a fresh interpreter importing torch (seconds of CPU per rank on a
small machine, which dominated a test suite of short multi-process tests). It behaves as
``spawn`` does for what a test can see: no state of the launching process is inherited (the
server started clean), ``fn`` and its arguments are pickled, and each rank gets the
launching process's environment of the moment it is launched, as a spawned one would. What
runs only when an interpreter starts (``.pth`` start-up hooks, such as the NVRx alias that
``RESILIENT_CKPT_NVRX_ALIAS`` switches on) ran in the server, under the environment of its
own start: a test of such a hook launches with ``start_method="spawn"``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

from .._logging import get_logger
from ..errors import CheckpointingException

logger = get_logger(__name__)

# How long a rank that sent its result may take to exit (its process-group teardown).
TEARDOWN_GRACE_S = 30.0


class RankFailure(CheckpointingException):
    """A rank raised, or exited without reporting a result."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class RankTimeout(CheckpointingException, TimeoutError):
    """Some ranks did not finish before the deadline (they were killed)."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    store_path: str,
    args: tuple,
    env: dict[str, str],
    conn: Connection,
    pg_timeout: float,
    process_group: bool,
) -> None:
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(env)
    _set_intra_op_threads(world_size)
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
    )
    try:
        if process_group:
            dist.init_process_group(
                "gloo",
                init_method=f"file://{store_path}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=pg_timeout),
            )
        result = fn(rank, world_size, *args)
        conn.send(("ok", result))
    except BaseException as exc:
        conn.send(("error", "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
        conn.close()


def _set_intra_op_threads(world_size: int) -> None:
    """One intra-op thread per rank unless ``OMP_NUM_THREADS`` says otherwise, as
    ``torchrun`` does for several ranks on one host: every rank's OpenMP pool would otherwise
    take all the cores and spin (measured here: a 4-rank restore's tensor copies ran 2-3x
    slower). Applied with ``torch.set_num_threads``: torch was imported before this runs."""
    import torch

    threads = os.environ.get("OMP_NUM_THREADS")
    if threads is None and world_size > 1:
        threads = "1"
        os.environ["OMP_NUM_THREADS"] = threads
    if threads is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


# Imported once by the fork server, so every rank starts with them.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "resilient_ckpt"]


def _context(start_method: str) -> Any:
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _kill_all(procs: list[Any]) -> None:
    for p in procs:
        if p.exitcode is None:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.join(5)


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    pg_timeout: float | None = None,
    process_group: bool = True,
    start_method: str = "forkserver",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the results.

    ``process_group=False`` starts the processes without a process group (for a function
    that forks or launches jobs of its own and must not carry one into them).
    ``start_method="spawn"`` starts each rank as a new interpreter (see the module docstring).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context(start_method)
    tmpdir = tempfile.mkdtemp(prefix="rc_launch_")
    store_path = os.path.join(tmpdir, "store")
    procs, conns = [], []
    for rank in range(world_size):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_rank_main,
            args=(
                fn,
                rank,
                world_size,
                store_path,
                args,
                {**os.environ, **(env or {})},
                child,
                pg_timeout if pg_timeout is not None else timeout,
                process_group,
            ),
            name=f"rank-{rank}",
        )
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        pending = {conns[r]: r for r in range(world_size)}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                hung = sorted(pending.values())
                raise RankTimeout(f"rank(s) {hung} did not finish within {timeout:.0f}s", hung)
            for ready in wait(list(pending), remaining):
                conn = ready if isinstance(ready, Connection) else None
                if conn is None:
                    continue
                rank = pending.pop(conn)
                try:
                    kind, value = conn.recv()
                except EOFError:
                    procs[rank].join(5)
                    raise RankFailure(
                        f"rank {rank} exited (exit code {procs[rank].exitcode}) without a result",
                        rank,
                    ) from None
                if kind == "error":
                    raise RankFailure(f"rank {rank} raised:\n{value}", rank)
                results[rank] = value
        # Every result is in: a rank still tearing its process group down (torch 2.5's
        # gloo can block there once its peers have exited) gets a grace period, not the
        # rest of the deadline, and is then killed by the clean-up below.
        teardown_ends = min(deadline, time.monotonic() + TEARDOWN_GRACE_S)
        for p in procs:
            p.join(max(0.1, teardown_ends - time.monotonic()))
        stuck = [r for r, p in enumerate(procs) if p.exitcode is None]
        if stuck:
            logger.warning(
                "rank(s) %s sent their results but did not exit within %.0fs; killed",
                stuck,
                TEARDOWN_GRACE_S,
            )
    finally:
        _kill_all(procs)
        for c in conns:
            c.close()
        try:
            for name in os.listdir(tmpdir):
                os.unlink(os.path.join(tmpdir, name))
            os.rmdir(tmpdir)
        except OSError:
            pass
    return [results[r] for r in range(world_size)]
