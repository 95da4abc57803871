"""Helpers for the multi-process local checkpoint tests (imported by spawned ranks)."""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

from resilient_ckpt.async_ckpt.core import AsyncCallsQueue
from resilient_ckpt.local import (
    BasicTensorAwareStateDict,
    CliqueReplicationStrategy,
    LocalCheckpointManager,
)
from resilient_ckpt.local._manifest import file_name
from resilient_ckpt.utils import diff
from tests._helpers import flip_byte as flip_byte  # (re-exported for the local tests)

Repl = tuple[int, int] | None  # (jump, factor)


def make_state(rank: int, step: int) -> dict[str, Any]:
    """A nested state with several dtypes, odd shapes and plain values, unique per rank/step."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {
        "model": {
            "w": torch.randn(64, 33, generator=g),
            "b": torch.randn(33, generator=g).to(torch.bfloat16),
            "t": torch.randn(5, 7, generator=g).t(),  # non-contiguous
        },
        "optim": [torch.randint(0, 1000, (17,), generator=g), (torch.tensor(step), "adam")],
        "flags": torch.rand(9, generator=g) > 0.5,
        "empty": torch.empty(0, 3),
        "meta": {"rank": rank, "step": step, "name": f"r{rank}", "none": None},
    }


def clone_state(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: clone_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [clone_state(v) for v in state]
    if isinstance(state, tuple):
        return tuple(clone_state(v) for v in state)
    return state


def mutate(state: Any) -> None:
    """Change every float tensor in place (to prove the snapshot was taken)."""
    for value in state["model"].values():
        value.add_(1)


def assert_same(expected: Any, actual: Any, what: str) -> None:
    only_left, only_right, mismatch = diff(expected, actual)
    if only_left or only_right or mismatch:
        raise AssertionError(f"{what}: differs: {only_left} {only_right} {mismatch}")
    for a, b in zip(_tensors(expected), _tensors(actual), strict=True):
        if a.dtype != b.dtype or a.shape != b.shape:
            raise AssertionError(f"{what}: dtype/shape differ {a.dtype} {b.dtype}")


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def strategy(repl: Repl) -> CliqueReplicationStrategy | None:
    if repl is None:
        return None
    jump, factor = repl
    return CliqueReplicationStrategy.from_replication_params(jump, factor)


def manager(root: str, repl_strategy: Any, **kwargs: Any) -> LocalCheckpointManager:
    return LocalCheckpointManager(root, "sess", repl_strategy, **kwargs)


class Saver:
    """Saves through the sync path, the persistent queue or the fork queue (one each)."""

    def __init__(self) -> None:
        self.queues: dict[str, AsyncCallsQueue] = {}

    def save(self, mgr: LocalCheckpointManager, state: Any, iteration: int, mode: str) -> None:
        ta = BasicTensorAwareStateDict(state)
        if mode == "sync":
            mgr.save(ta, iteration)
            return
        queue = self.queues.get(mode)
        if queue is None:
            queue = self.queues[mode] = AsyncCallsQueue(persistent=(mode == "persistent"))
        request = mgr.save(ta, iteration, is_async=True)
        queue.schedule_async_request(request)
        mutate(state)  # the checkpoint must hold the values at save time
        queue.maybe_finalize_async_calls(blocking=True)

    def close(self) -> None:
        for queue in self.queues.values():
            queue.close()


def load_fresh(root: str, repl_strategy: Any, **kwargs: Any) -> tuple[int, Any]:
    """find_latest + load with a new manager (nothing cached), as after a restart."""
    mgr = manager(root, repl_strategy, **kwargs)
    latest = mgr.find_latest()
    if latest == -1:
        return -1, None
    state, ckpt_id = mgr.load()
    assert ckpt_id == (latest, dist.get_rank(), "sess"), ckpt_id
    return latest, state.state_dict


def rank_dir(root: str, rank: int) -> str:
    return os.path.join(root, "sess", str(rank))


def wipe(root: str, rank: int) -> None:
    shutil.rmtree(rank_dir(root, rank), ignore_errors=True)


def listing(root: str) -> list[str]:
    """This rank's files, without hidden ones (files being deleted in the background)."""
    names = os.listdir(rank_dir(root, dist.get_rank()))
    return sorted(n for n in names if not n.startswith("."))


def barrier() -> None:
    dist.barrier()


def copy_path(root: str, holder: int, iteration: int, owner: int) -> str:
    """Where ``holder`` keeps its copy of ``owner``'s shard of ``iteration``."""
    return os.path.join(rank_dir(root, holder), file_name(iteration, owner))


def save_two(rank: int, base: str, strat: object) -> dict[int, dict]:
    """Iterations 10 and 20 saved (kept both); the states saved, by iteration."""
    mgr = manager(base, strat, keep_latest=2)
    states = {it: make_state(rank, it) for it in (10, 20)}
    for it, state in states.items():
        mgr.save(BasicTensorAwareStateDict(clone_state(state)), it)
    return states


class LogCapture(logging.Handler):
    """Collects the library's log messages in this process."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []
        lib = logging.getLogger("resilient_ckpt")
        lib.addHandler(self)
        lib.setLevel(logging.INFO)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
