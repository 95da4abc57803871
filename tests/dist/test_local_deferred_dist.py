"""Deferred preparation of async local saves (``LocalCheckpointManager(...,
defer_planning=True)``) across ranks: the checks, the layout and their agreement run on
the staging thread (overlapped or not, on the persistent queue and on the fork queue,
whose ``preload_fn`` plans it); every committed iteration loads with the values of its call, a
structure change included; a bad request on one rank, or ranks saving different
iterations, fails on every rank where the snapshot is staged, and the next save works."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from resilient_ckpt.testing import launch

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]


def _state(rank: int) -> dict:
    gen = torch.Generator().manual_seed(rank)
    return {"w": {f"p{i}": torch.randn(40 + i, generator=gen) for i in range(25)}, "step": 0}


def _rounds(rank: int, world: int, root: str) -> list:
    from resilient_ckpt.async_ckpt.core import AsyncCallsQueue
    from resilient_ckpt.local import BasicTensorAwareStateDict, LocalCheckpointManager

    warnings.filterwarnings("ignore")
    prepared_on: list[str] = []
    manager = LocalCheckpointManager(root, "deferred", defer_planning=True)
    real_prepare = manager._prepare

    def recording_prepare(*args, **kwargs):
        prepared_on.append(threading.current_thread().name)
        return real_prepare(*args, **kwargs)

    manager._prepare = recording_prepare
    queues = {"persistent": AsyncCallsQueue(), "fork": AsyncCallsQueue(persistent=False)}
    state = _state(rank)
    out = []
    try:
        for iteration, (kind, overlap) in enumerate(
            [("persistent", True), ("persistent", True), ("persistent", False), ("fork", False)],
            start=1,
        ):
            if iteration == 2 and rank == 1:
                state["w"]["extra"] = torch.arange(9.0)  # a structure change on one rank
            state["step"] = iteration
            prepared_on.clear()
            queue = queues[kind]
            request = manager.save(BasicTensorAwareStateDict(state), iteration, True)
            in_call = list(prepared_on)
            queue.schedule_async_request(request, overlap_staging=overlap)
            queue.wait_for_snapshot()
            expected = {k: v.clone() for k, v in state["w"].items()}
            for tensor in state["w"].values():
                tensor.mul_(3).sub_(1)
            queue.maybe_finalize_async_calls(blocking=True)
            latest = manager.find_latest()
            loaded, _ = manager.load()
            got = loaded.state_dict
            exact = (
                got["step"] == iteration
                and all(torch.equal(got["w"][k], v) for k, v in expected.items())
                and set(got["w"]) == set(expected)
            )
            out.append((kind, overlap, in_call, list(prepared_on), latest, exact))
    finally:
        for queue in queues.values():
            queue.close()
    return out


def test_deferred_local_saves_prepare_at_staging_and_load_the_values_of_the_call(
    tmp_path,
) -> None:
    for rank, rounds in enumerate(launch(_rounds, 2, str(tmp_path), timeout=160)):
        for iteration, (kind, overlap, in_call, prepared, latest, exact) in enumerate(
            rounds, start=1
        ):
            where = (rank, iteration, kind, overlap, prepared)
            assert in_call == [] and len(prepared) == 1, where  # nothing prepared in save()
            assert prepared[0].startswith("resilient_ckpt-stage"), where  # always staging's
            assert latest == iteration and exact, where


def _failures(rank: int, world: int, root: str) -> list:
    from resilient_ckpt.async_ckpt.core import AsyncCallsQueue
    from resilient_ckpt.errors import CheckpointingException, ConfigurationError
    from resilient_ckpt.local import BasicTensorAwareStateDict, LocalCheckpointManager

    warnings.filterwarnings("ignore")
    manager = LocalCheckpointManager(root, "deferred", defer_planning=True)
    queue = AsyncCallsQueue()
    state = _state(rank)
    out: list = []
    try:
        attempts = [
            # rank 1 hands a plain dict, not a TensorAwareStateDict
            (3, state if rank == 1 else BasicTensorAwareStateDict(state)),
            # the ranks save different iterations
            (4 + rank, BasicTensorAwareStateDict(state)),
        ]
        for iteration, payload in attempts:
            try:
                request = manager.save(payload, iteration, True)
                queue.schedule_async_request(request, overlap_staging=True)
                queue.wait_for_snapshot()
            except ConfigurationError as exc:
                out.append((type(exc).__name__, str(exc)))
            else:
                out.append(("", ""))
            # The failed call is reported by the next finalize, once; the one after is clean.
            reports = []
            for _ in range(2):
                try:
                    reports.append(("", queue.maybe_finalize_async_calls(blocking=True)))
                except CheckpointingException as exc:
                    cause = exc.__cause__
                    reports.append(
                        (
                            type(exc).__name__,
                            sorted(getattr(exc, "failed_ranks", [])),
                            type(cause).__name__,
                            str(cause),
                        )
                    )
            out.append((reports, queue.get_num_unfinalized_calls()))
        request = manager.save(BasicTensorAwareStateDict(state), 9, True)
        queue.schedule_async_request(request, overlap_staging=True)
        queue.wait_for_snapshot()
        queue.maybe_finalize_async_calls(blocking=True)
        out.append(manager.find_latest())
    finally:
        queue.close()
    return out


def test_a_deferred_local_save_failing_anywhere_fails_everywhere_then_saves_go_on(
    tmp_path,
) -> None:
    for rank, (bad_state, bad_finalized, different, different_finalized, latest) in enumerate(
        launch(_failures, 2, str(tmp_path), timeout=160)
    ):
        kind, message = bad_state
        assert kind == "RankConfigurationError", (rank, bad_state)
        assert "rank(s) [1]" in message and "TensorAwareStateDict" in message, (rank, message)
        kind, message = different
        assert kind == "ConfigurationError" and "different iterations" in message, (rank, different)
        # The next finalize raises the staging's error once, on every rank, as a failure of
        # the request on all ranks caused by it; the finalize after it has nothing left.
        for (first, second), pending in (bad_finalized, different_finalized):
            assert first[:2] == ("RankConfigurationError", [0, 1]), (rank, first)
            assert second == ("", []) and pending == 0, (rank, second, pending)
        assert bad_finalized[0][0][2:] == ("RankConfigurationError", bad_state[1]), rank
        assert different_finalized[0][0][2:] == ("ConfigurationError", different[1]), rank
        assert latest == 9, (rank, latest)
