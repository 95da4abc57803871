"""The documented warm-ups (issue 13, "no cold first save"), across ranks: the first save
after them holds exactly the values of its call, on every rank. (That it takes the steady
paths is the performance contract, ``tests/unit/test_performance_contract.py``.)"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from resilient_ckpt.testing import launch

from .local_ckpt_utils import assert_same, clone_state, make_state, manager, mutate, strategy

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]


def _local(rank: int, world: int, root: str, replicated: bool) -> None:
    from resilient_ckpt.async_ckpt.core import AsyncCallsQueue
    from resilient_ckpt.local import BasicTensorAwareStateDict

    repl = strategy((1, 2)) if replicated else None
    mgr = manager(root, repl)
    queue = AsyncCallsQueue()
    state = make_state(rank, 1)
    try:
        mgr.warmup(BasicTensorAwareStateDict(state), queue)
        mutate(state)  # values change after the warm-up, the structure does not
        expected = clone_state(state)
        request = mgr.save(BasicTensorAwareStateDict(state), 1, is_async=True)
        queue.schedule_async_request(request)
        mutate(state)  # after the call: not in the checkpoint
        queue.maybe_finalize_async_calls(blocking=True)
        loaded = manager(root, strategy((1, 2)) if replicated else None)
        assert loaded.find_latest() == 1
        assert_same(expected, loaded.load()[0].state_dict, f"rank {rank}")
    finally:
        queue.close()


@pytest.mark.parametrize("replicated", [False, True], ids=["unreplicated", "replicated"])
def test_the_first_local_save_after_a_warmup_is_exact(tmp_path, replicated) -> None:
    launch(_local, 2, str(tmp_path), replicated)


def _dcp(rank: int, world: int, root: str) -> bool:
    import torch.distributed.checkpoint as dcp

    from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
    from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
    from resilient_ckpt.async_ckpt.state_dict_saver import (
        CheckpointMetadataCache,
        save_state_dict_async_finalize,
        save_state_dict_async_plan,
    )
    from resilient_ckpt.async_ckpt.warmup import warmup_async_save

    warnings.filterwarnings("ignore")
    state: dict = {f"r{rank}.w{i}": torch.full((5 + i,), float(rank)) for i in range(8)}
    cache = CheckpointMetadataCache()
    queue = AsyncCallsQueue()
    try:
        warmup_async_save(state, queue, metadata_cache=cache, thread_count=1)
        for value in state.values():
            value.add_(1)
        expected = {k: v.clone() for k, v in state.items()}
        path = os.path.join(root, "s1")
        writer = FileSystemWriterAsync(path, thread_count=1)
        ret = save_state_dict_async_plan(state, writer, enable_cache=True, metadata_cache=cache)
        save_fn, preload_fn, args = writer.get_save_function_and_args()
        finalize = [lambda: save_state_dict_async_finalize(*ret)]
        queue.schedule_async_request(AsyncRequest(save_fn, args, finalize, preload_fn=preload_fn))
        for value in state.values():
            value.add_(1000)
        queue.maybe_finalize_async_calls(blocking=True)
        target = {k: torch.zeros_like(v) for k, v in expected.items()}
        dcp.load(target, checkpoint_id=path)
        return all(torch.equal(target[k], v) for k, v in expected.items())
    finally:
        queue.close()


def test_the_first_dcp_save_after_a_warmup_is_exact(tmp_path) -> None:
    for rank, same in enumerate(launch(_dcp, 2, str(tmp_path))):
        assert same, f"rank {rank}: the checkpoint does not hold the call's values"
