"""Shared by the fault scenarios: trial outcomes, states, DCP save/restore helpers.

Imported by spawned and forked ranks, so everything here is module-level.
"""

from __future__ import annotations

import functools
import os
import shutil
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed
import torch.distributed.checkpoint as dcp

from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from resilient_ckpt.async_ckpt.state_dict_saver import (
    CheckpointMetadataCache,
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from resilient_ckpt.cli.checkpoints import discover
from resilient_ckpt.local import (
    BasicTensorAwareStateDict,
    CliqueReplicationStrategy,
    LocalCheckpointManager,
)
from resilient_ckpt.storage.commit import fsync_dir
from resilient_ckpt.testing import RankFailure, RankTimeout, launch
from resilient_ckpt.testing.faults import (
    Fault,
    FaultyLocalCheckpointManager,
    FaultyWriter,
    faulty_request,
)
from resilient_ckpt.utils import diff


@dataclass
class Trial:
    """One trial of a scenario: did every "must hold" hold, did it hang, how long to the
    error (or, where no error is expected, to the checked outcome)."""

    passed: bool
    hung: bool = False
    seconds: float | None = None
    detail: str = ""


def failed(detail: str, seconds: float | None = None) -> Trial:
    return Trial(False, False, seconds, detail)


def hung(detail: str, seconds: float | None = None) -> Trial:
    return Trial(False, True, seconds, detail)


def from_exception(what: str, exc: BaseException) -> Trial:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return failed(f"{what}: {text}")


def summarize(trials: list[Trial]) -> str:
    """The failed trials, for an assertion message."""
    bad = [
        f"trial {k}: {'HUNG ' if t.hung else ''}{t.detail}"
        for k, t in enumerate(trials)
        if not t.passed
    ]
    return f"{len(bad)} of {len(trials)} trials failed:\n" + "\n".join(bad)


def merge(per_rank: tuple[Trial, ...] | list[Trial]) -> Trial:
    """One trial seen from every rank: it passed if it passed on all of them."""
    seconds = max((t.seconds or 0.0) for t in per_rank)
    details = "; ".join(f"rank {r}: {t.detail}" for r, t in enumerate(per_rank) if not t.passed)
    return Trial(all(t.passed for t in per_rank), any(t.hung for t in per_rank), seconds, details)


def launch_trials(
    fn: Callable[..., Any], world: int, *args: Any, trials: int, timeout: float
) -> list[Trial]:
    """``launch(fn, world, *args)`` whose ranks each return ``trials`` Trials; merged per
    trial. A job that hangs or crashes counts against every trial (the runs are lost)."""
    started = time.monotonic()
    try:
        per_rank = launch(fn, world, *args, timeout=timeout)
    except RankTimeout as exc:
        return [hung(f"the job hung: {exc}", time.monotonic() - started)] * trials
    except RankFailure as exc:
        return [failed(f"the job crashed: {exc}")] * trials
    return [merge(ts) for ts in zip(*per_rank, strict=True)]


def launch_rows(
    fn: Callable[..., Any], world: int, *args: Any, counts: dict[str, int], timeout: float
) -> dict[str, list[Trial]]:
    """Like :func:`launch_trials` for a job whose ranks return ``{row: [Trial, ...]}``."""
    started = time.monotonic()
    try:
        per_rank = launch(fn, world, *args, timeout=timeout)
    except RankTimeout as exc:
        lost = hung(f"the job hung: {exc}", time.monotonic() - started)
        return {row: [lost] * n for row, n in counts.items()}
    except RankFailure as exc:
        return {row: [failed(f"the job crashed: {exc}")] * n for row, n in counts.items()}
    return {
        row: [merge(ts) for ts in zip(*(r[row] for r in per_rank), strict=True)]
        for row in per_rank[0]
    }


# -- states --------------------------------------------------------------------------------


def tensor_state(rank: int, iteration: int, nbytes: int, salt: int = 0) -> dict[str, Any]:
    """A state unique to (rank, iteration): a large float tensor, small odd-typed ones."""
    g = torch.Generator().manual_seed(1_000_003 * salt + 1009 * rank + iteration)
    return {
        f"r{rank}.w": torch.randn(max(1, nbytes // 4), generator=g),
        f"r{rank}.b": torch.randn(33, generator=g).to(torch.bfloat16),
        f"r{rank}.i": torch.randint(0, 1 << 30, (17,), generator=g),
        f"r{rank}.step": torch.tensor(iteration),
    }


def zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def same(expected: Any, actual: Any) -> str | None:
    """None if bit-exact (values, dtypes, shapes), else what differs."""
    only_left, only_right, mismatch = diff(expected, actual)
    if only_left or only_right or mismatch:
        return f"differs: {only_left} {only_right} {mismatch}"
    if isinstance(expected, dict):
        for key, value in expected.items():
            other = actual[key]
            if torch.is_tensor(value) and (
                value.dtype != other.dtype or value.shape != other.shape
            ):
                return (
                    f"{key}: {value.dtype}{tuple(value.shape)} vs {other.dtype}{tuple(other.shape)}"
                )
    return None


def mutate(state: dict[str, Any]) -> None:
    """Training goes on right after a save was scheduled."""
    for value in state.values():
        if value.is_floating_point():
            value.add_(1)


# -- DCP -----------------------------------------------------------------------------------


def dcp_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def dcp_request(
    state: dict[str, Any],
    path: str,
    cache: CheckpointMetadataCache | None = None,
    writer: FileSystemWriterAsync | None = None,
    finalize: list[Callable[[], Any]] | None = None,
) -> AsyncRequest:
    """Plan an async DCP save of ``state`` to ``path`` (collective); the request to schedule."""
    writer = writer if writer is not None else FileSystemWriterAsync(path, thread_count=2)
    plan = save_state_dict_async_plan(
        state, writer, enable_cache=cache is not None, metadata_cache=cache
    )
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    fns: list[Callable[[], Any]] = [functools.partial(save_state_dict_async_finalize, *plan)]
    return AsyncRequest(save_fn, args, fns + list(finalize or []), preload_fn=preload_fn)


def latest_dcp(root: str) -> tuple[int, list[str]]:
    """The newest committed DCP checkpoint under ``root`` that verifies (-1 if none), and
    problems: a committed checkpoint that fails verification must never exist."""
    if not os.path.isdir(root):
        return -1, []
    problems, good = [], []
    for entry in discover(root, verify=True):
        if entry.kind != "dcp" or not (entry.committed or entry.corrupt):
            continue
        if entry.verified and entry.iteration is not None:
            good.append(entry.iteration)
        else:
            problems.append(f"committed DCP checkpoint {entry.path} fails: {entry.problems}")
    return max(good, default=-1), problems


def load_dcp(root: str, iteration: int, expected: dict[str, Any]) -> str | None:
    """Load ``iteration`` into zeros shaped like ``expected``; None if bit-exact."""
    loaded = zeros_like(expected)
    dcp.load(loaded, checkpoint_id=dcp_dir(root, iteration))
    return same(expected, loaded)


def drop_dcp(root: str, iteration: int) -> None:
    """Retention: uncommit first (durably), then delete, so a crash half-way through never
    leaves a commit record over missing files."""
    path = dcp_dir(root, iteration)
    try:
        os.unlink(os.path.join(path, ".metadata"))
        fsync_dir(path)
    except FileNotFoundError:
        pass
    shutil.rmtree(path, ignore_errors=True)


# -- local ---------------------------------------------------------------------------------


def clique_strategy() -> CliqueReplicationStrategy:
    """Replication factor 2 over adjacent ranks (cliques {0,1}, {2,3}, ...)."""
    return CliqueReplicationStrategy.from_replication_params(1, 2)


def local_manager(root: str, replicated: bool, **kwargs: Any) -> FaultyLocalCheckpointManager:
    """A local checkpoint manager (with no faults unless its ``faults`` are set)."""
    strategy = clique_strategy() if replicated else None
    return FaultyLocalCheckpointManager(root, "sess", strategy, **kwargs)


def restore_local(
    mgr: LocalCheckpointManager, expected: Callable[[int], Any]
) -> tuple[int, str | None]:
    """find_latest + load (collective); the iteration and None if the load is bit-exact."""
    latest = mgr.find_latest()
    if latest == -1:
        return -1, None
    state, _ = mgr.load()
    assert isinstance(state, BasicTensorAwareStateDict)
    return latest, same(expected(latest), state.state_dict)


def dirty_leftovers(mgr: LocalCheckpointManager) -> list[str]:
    """Files of interrupted saves still visible in this rank's directory."""
    directory = str(mgr.local_ckpt_dir)
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return [n for n in names if not n.startswith(".") and (".dirty." in n or ".status" in n)]


def new_queue(mode: str, **kwargs: Any) -> AsyncCallsQueue:
    return AsyncCallsQueue(persistent=(mode == "persistent"), **kwargs)


def wait_ready(queue: AsyncCallsQueue) -> None:
    """Start the background worker now (a no-op request waits for its handshake)."""
    queue.schedule_async_request(AsyncRequest(None, (), []))
    queue.maybe_finalize_async_calls(blocking=True, no_dist=False)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.monotonic()
    return fn(), time.monotonic() - started


# -- the three kinds of save of the scenarios ----------------------------------------------

KINDS = ("dcp", "plain", "repl")


class Saves:
    """The three kinds of save of this job, and what each last committed."""

    def __init__(self, rank: int, root: str, nbytes: int) -> None:
        self.rank = rank
        self.nbytes = nbytes
        self.dcp_root = os.path.join(root, "dcp")
        self.managers = {
            "plain": local_manager(os.path.join(root, "plain"), replicated=False),
            "repl": local_manager(os.path.join(root, "repl"), replicated=True),
        }
        self.committed = {kind: -1 for kind in KINDS}

    def state(self, kind: str, iteration: int) -> dict[str, Any]:
        return tensor_state(self.rank, iteration, self.nbytes, salt=KINDS.index(kind) + 11)

    def request(
        self,
        kind: str,
        iteration: int,
        faults: Sequence[Fault] = (),
        write_faults: Sequence[Fault] = (),
    ) -> Any:
        """The async request of a save (DCP: planned here, collective). ``faults`` fire in
        the background call (and, for DCP, in every phase of the writer); ``write_faults``
        in a local manager's copy writes, wherever they run."""
        state = self.state(kind, iteration)
        if kind == "dcp":
            path = dcp_dir(self.dcp_root, iteration)
            writer = FaultyWriter(path, thread_count=2, faults=faults)
            return dcp_request(state, path, writer=writer)
        mgr = self.managers[kind]
        mgr.faults = tuple(write_faults)
        request = mgr.save(BasicTensorAwareStateDict(state), iteration, is_async=True)
        return faulty_request(request, faults) if faults else request

    def save_sync(self, kind: str, iteration: int, write_faults: Sequence[Fault] = ()) -> None:
        """A synchronous save (DCP: through ``execute_sync``)."""
        if kind == "dcp":
            self.request(kind, iteration, write_faults).execute_sync()
            return
        mgr = self.managers[kind]
        mgr.faults = tuple(write_faults)
        mgr.save(BasicTensorAwareStateDict(self.state(kind, iteration)), iteration)

    def check_committed(self, kind: str, iteration: int) -> str | None:
        """``iteration`` is the newest checkpoint and loads bit-exact; record it. For DCP,
        rank 0 then deletes every other checkpoint directory (the user's retention)."""
        self.committed[kind] = iteration
        problem = self.check_previous(kind, iteration + 1)
        if kind == "dcp":
            torch.distributed.barrier()
            if self.rank == 0:
                for name in os.listdir(self.dcp_root):
                    if name != os.path.basename(dcp_dir(self.dcp_root, iteration)):
                        drop_dcp(self.dcp_root, int(name.split("_")[1]))
            torch.distributed.barrier()
        return problem

    def check_previous(self, kind: str, failed_iteration: int) -> str | None:
        """The failed save is not committed; the previous committed one loads bit-exact."""
        previous = self.committed[kind]
        expected = lambda it: self.state(kind, it)  # noqa: E731
        if kind == "dcp":
            if os.path.exists(os.path.join(dcp_dir(self.dcp_root, failed_iteration), ".metadata")):
                return f"DCP iteration {failed_iteration} was committed"
            latest, problems = latest_dcp(self.dcp_root)
            bad = load_dcp(self.dcp_root, latest, expected(latest)) if latest >= 0 else None
        else:
            latest, bad = restore_local(self.managers[kind], expected)
            problems = []
        if latest != previous or bad or problems:
            return f"{kind}: latest {latest} (expected {previous}) {bad or ''} {problems}"
        return None
