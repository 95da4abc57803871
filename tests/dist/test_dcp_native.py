"""``resilient_ckpt.dcp`` on 2 gloo ranks: its ``async_save``, ``Stager`` and ``FileSystemWriter``
against torch's own ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` (issue 48).

Each launch costs seconds on a small machine, so each test packs its checks into one launch;
rank functions assert, and a failure comes back as a ``RankFailure`` with its traceback.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from resilient_ckpt.cli import main as cli_main
from resilient_ckpt.testing.launcher import launch
from tests import _helpers
from tests._helpers import flip_byte, rss_bytes

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

PROCESS, THREAD = AsyncCheckpointerType.PROCESS, AsyncCheckpointerType.THREAD


def _model(world: int) -> torch.nn.Module:
    return _helpers.fsdp2_model(world)


def _state(model: torch.nn.Module, rank: int, step: int) -> dict[str, Any]:
    """FSDP2-sharded weights, a replicated tensor, a rank-own value and a step."""
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().add_(step)  # type: ignore[attr-defined]
    return {
        "model": model.state_dict(),
        "replicated": torch.arange(100, dtype=torch.float64) * step,
        f"rank{rank}": torch.full((5,), float(rank + step)),
        "step": step,
    }


def _empty_like(state: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return {k: _empty_like(v) for k, v in state.items()}
    if isinstance(state, DTensor):
        return DTensor.from_local(
            torch.full_like(state.to_local(), -1.0),
            state.device_mesh,
            state.placements,
            shape=state.shape,
            stride=state.stride(),
        )
    if isinstance(state, torch.Tensor):
        return torch.full_like(state, -1)
    return None


def _assert_same(loaded: Any, saved: Any, where: str = "") -> None:
    from torch.distributed.tensor import DTensor

    if isinstance(saved, dict):
        assert loaded.keys() == saved.keys(), where
        for k in saved:
            _assert_same(loaded[k], saved[k], f"{where}.{k}")
    elif isinstance(saved, DTensor):
        assert torch.equal(loaded.to_local(), saved.to_local()), where
    elif isinstance(saved, torch.Tensor):
        assert torch.equal(loaded, saved), where
    else:
        assert loaded == saved, where


def _load_and_compare(path: str, saved: dict[str, Any]) -> None:
    """Plain torch reads it back bit-exact (on the same sharding)."""
    target = _empty_like(saved)
    dcp.load(target, checkpoint_id=path)
    _assert_same(target, saved)


def _clone_state(state: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return {k: _clone_state(v) for k, v in state.items()}
    if isinstance(state, DTensor):
        return DTensor.from_local(
            state.to_local().clone(),
            state.device_mesh,
            state.placements,
            shape=state.shape,
            stride=state.stride(),
        )
    if isinstance(state, torch.Tensor):
        return state.clone()
    return state


# -- FileSystemWriter in torch's own saves -------------------------------------------------------


def _torch_saves_with_our_writer(rank: int, world: int, root: str) -> list[str]:
    from resilient_ckpt.dcp import FileSystemWriter, Stager

    model = _model(world)
    stager = Stager()  # FSDP2 shards staged as DTensors, for both executors
    paths = []
    for step, how in enumerate(("save", "thread", "process"), start=1):
        path = os.path.join(root, how)
        state = _state(model, rank, step)
        expected = _clone_state(state)
        writer = FileSystemWriter(path)
        if how == "save":
            dcp.save(state, storage_writer=writer)
        else:
            kind = AsyncCheckpointerType(how)
            dcp.async_save(
                state, storage_writer=writer, async_checkpointer_type=kind, async_stager=stager
            ).result()
        _load_and_compare(path, expected)
        paths.append(path)
    stager.close()
    return paths


def test_our_writer_and_stager_in_torch_save_and_async_save_record_every_ranks_checksums(
    tmp_path, capsys
) -> None:
    from resilient_ckpt.async_ckpt.verify import verify_checkpoint

    paths = launch(_torch_saves_with_our_writer, 2, str(tmp_path), timeout=240)[0]
    for path in paths:
        verified = verify_checkpoint(path)
        assert verified.checksummed, path
        # Both ranks' data files are in the table (not only the coordinator's).
        assert sorted(verified.files) == ["__0_0.distcp", "__1_0.distcp"], verified.files
        assert cli_main(["verify", path]) == 0
        assert "every byte checksummed" in capsys.readouterr().out
    flip_byte(os.path.join(paths[-1], "__1_0.distcp"))
    assert cli_main(["verify", paths[-1]]) != 0
    out = capsys.readouterr()
    assert "__1_0.distcp: CRC32" in out.out + out.err


# -- resilient_ckpt.dcp.async_save ----------------------------------------------------------------


def _our_async_saves(rank: int, world: int, root: str) -> list[str]:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    import resilient_ckpt.dcp as rdcp

    model = _model(world)
    gloo = dist.new_group(backend="gloo")  # as torchtitan passes one
    kinds = []
    cases = [
        (THREAD, None, {}),
        (PROCESS, None, {"process_group": gloo}),
        (PROCESS, rdcp.Stager(), {}),
        (THREAD, rdcp.Stager(async_staging=True), {}),
        (PROCESS, DefaultStager(StagingOptions(False, False, True, False)), {}),
        (THREAD, None, {"storage_writer": rdcp.FileSystemWriter(os.path.join(root, "x"))}),
    ]
    pending = []
    for step, (kind, stager, extra) in enumerate(cases, start=1):
        path = os.path.join(root, f"save{step}")
        state = _state(model, rank, step)
        expected = _clone_state(state)
        answer = rdcp.async_save(
            state,
            checkpoint_id=path,
            async_checkpointer_type=kind,
            async_stager=stager,
            **extra,
        )
        if isinstance(answer, AsyncSaveResponse):
            kinds.append("response")
            answer.staging_completion.result()  # the state may change only after this
            future = answer.upload_completion
        else:
            kinds.append(type(answer).__mro__[1].__name__)
            future = answer
        pending.append((future, path, expected))
    for future, path, expected in pending:
        metadata = future.result()
        assert future.done()
        assert (metadata is not None) == (rank == 0)
        _load_and_compare(path, expected)
    rdcp.close()
    rdcp.close()
    return kinds


def test_async_save_round_trips_sharded_and_replicated_state_and_answers_as_torch(
    tmp_path,
) -> None:
    from resilient_ckpt.async_ckpt.verify import verify_checkpoint

    kinds = launch(_our_async_saves, 2, str(tmp_path), timeout=240)
    expected = ["Future", "Future", "Future", "response", "response", "Future"]
    assert kinds == [expected, expected]
    for step in range(1, 7):
        verified = verify_checkpoint(str(tmp_path / f"save{step}"))
        assert verified.checksummed and len(verified.files) == 2


def _failure_on_rank_1(rank: int, world: int, root: str) -> str:
    import resilient_ckpt.dcp as rdcp
    from resilient_ckpt.errors import ConfigurationError, RankFailureError
    from resilient_ckpt.testing.faults import Action, Fault, FaultyWriter, Phase

    path = os.path.join(root, "failed")
    fault = Fault(Phase.WRITE, Action.RAISE, ranks=[1], match="*.distcp")
    state = {"w": torch.arange(1000.0), f"rank{rank}": torch.full((3,), float(rank)), "step": 1}
    future = rdcp.async_save(state, storage_writer=FaultyWriter(path, faults=[fault]))
    try:
        future.result()
    except RankFailureError as exc:
        failed = exc.failed_ranks
    else:
        raise AssertionError("the save with a failed write on rank 1 did not raise")
    assert list(failed) == [1], failed
    assert isinstance(future.exception(), RankFailureError)
    assert not os.path.exists(os.path.join(path, ".metadata"))
    # The engine goes on: the next save commits.
    good = os.path.join(root, "good")
    rdcp.async_save(state, checkpoint_id=good).result()
    target = {"w": torch.zeros(1000), f"rank{rank}": torch.zeros(3), "step": 0}
    dcp.load(target, checkpoint_id=good)
    assert all(torch.equal(target[k], state[k]) for k in ("w", f"rank{rank}"))
    assert target["step"] == 1
    # What the engine cannot honour is named, on the rank that passed it.
    try:
        rdcp.async_save(state, checkpoint_id=good, no_dist=True)
    except ConfigurationError as exc:
        assert "no_dist" in str(exc)
    else:
        raise AssertionError("no_dist=True with a process group was accepted")
    rdcp.close()
    return type(future.exception()).__name__


def test_a_failure_on_one_rank_raises_on_both_and_commits_nothing(tmp_path) -> None:
    assert launch(_failure_on_rank_1, 2, str(tmp_path), timeout=240) == ["RankFailureError"] * 2


# -- Stager inside torch's dcp.async_save ------------------------------------------------------


def _stager_in_torch(rank: int, world: int, root: str, saves: int) -> dict[str, Any]:
    from multiprocessing.reduction import ForkingPickler

    import resilient_ckpt.dcp as rdcp

    stager = rdcp.Stager()
    state = {f"t{i}": torch.rand(64 * 1024) for i in range(32)}  # 8 MiB in 32 tensors
    state["step"] = 0
    counts, rss = [], []
    for n in range(saves):
        kind = PROCESS if n % 2 else THREAD
        state["step"] = n
        for i in range(32):
            state[f"t{i}"].add_(1.0)
        expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        path = os.path.join(root, f"r{rank}_{n}")
        future = dcp.async_save(
            state,
            storage_writer=rdcp.FileSystemWriter(path),
            async_checkpointer_type=kind,
            async_stager=stager,
            no_dist=True,
        )
        future.result()
        counts.append(stager.arena_count)
        rss.append(rss_bytes())
        if n in (0, 1, saves - 1):
            target = {
                k: torch.empty_like(v) if isinstance(v, torch.Tensor) else -1
                for k, v in expected.items()
            }
            dcp.load(target, checkpoint_id=path, no_dist=True)
            assert all(torch.equal(target[k], expected[k]) for k in expected if k != "step")
            assert target["step"] == n
        if n > 2:
            for name in os.listdir(path):
                os.unlink(os.path.join(path, name))
    # What the process executor sends: handles to the arena, not its bytes.
    staged = stager.stage(state)
    pointers = [staged[f"t{i}"].data_ptr() for i in range(32)]
    payload = ForkingPickler.dumps(staged)
    assert [staged[f"t{i}"].data_ptr() for i in range(32)] == pointers  # not moved
    assert all(staged[f"t{i}"].untyped_storage().is_shared() for i in range(32))
    stager.close()
    stager.close()
    return {"counts": counts, "rss": rss, "payload": len(payload)}


def test_stager_in_torch_async_save_both_executors_keeps_memory_flat(tmp_path) -> None:
    saves = 50
    results = launch(_stager_in_torch, 2, str(tmp_path), saves, timeout=280)
    for result in results:
        # At most max_arenas (2) ever exist: a second one appears when a save is staged while
        # the executor still holds the previous snapshot, never a third (a snapshot not
        # reused would make the 3rd save wait and fail with StagingError).
        assert max(result["counts"]) <= 2, result["counts"]
        # RSS from the 10th save to the last: less than the two arenas' 16 MiB plus slack
        # (a new staging copy per save would add 8 MiB each time, 320 MiB over 40 saves).
        growth = max(result["rss"][10:]) - result["rss"][10]
        assert growth < 24 << 20, growth
        assert result["payload"] < 64 << 10, result["payload"]  # not the 8 MiB
