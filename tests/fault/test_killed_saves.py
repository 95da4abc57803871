"""What a trainer SIGKILLed mid-save leaves, and that every tool sees it (issue 47, point 2).

The kill comes from the trainer's own background worker, at an exact byte of a data file
(the fault kit's ``Action.KILL_PARENT``), so the save is always interrupted mid-write: the
worker has its temporary file open, and dies with its parent. Then the tools run on what is
left: ``ls`` lists the interrupted save as incomplete, ``latest_checkpoint`` returns the
committed one before it (which loads bit-exact), ``prune`` removes the leftover once a newer
checkpoint is committed, and a new ``TorchAsyncCheckpoint`` save removes the dead writer's
temporary file.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from resilient_ckpt.async_ckpt.state_dict_saver import (
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from resilient_ckpt.async_ckpt.torch_ckpt import TorchAsyncCheckpoint
from resilient_ckpt.cli import main
from resilient_ckpt.storage import latest_checkpoint
from resilient_ckpt.storage.commit import parse_temp_name
from resilient_ckpt.testing import RankFailure, launch
from resilient_ckpt.testing.faults import Action, Fault, FaultyWriter, Phase, wait_gone

pytestmark = [pytest.mark.fault, pytest.mark.dist, pytest.mark.timeout(240)]

WORKER_GONE_S = 30.0  # the dead trainer's worker exits on its parent's death


def _state(rank: int, iteration: int) -> dict:
    gen = torch.Generator().manual_seed(1000 * iteration + rank)
    return {f"rank{rank}": torch.randn(256, 64, generator=gen), "iteration": iteration}


def _dcp_save(queue: AsyncCallsQueue, state: dict, writer: FileSystemWriterAsync) -> None:
    plan = save_state_dict_async_plan(state, writer)
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    commit = functools.partial(save_state_dict_async_finalize, *plan)
    queue.schedule_async_request(AsyncRequest(save_fn, args, [commit], preload_fn=preload_fn))
    queue.maybe_finalize_async_calls(blocking=True, no_dist=False)


# Each rank's worker SIGKILLs its trainer at byte 1024 of its data file, then lingers (it
# dies of its parent's death): that file stays a temporary file.
_KILL_MID_WRITE = [
    Fault(Phase.WRITE, Action.KILL_PARENT, match="*.distcp", after_bytes=1024),
    Fault(Phase.WRITE, Action.DELAY, match="*.distcp", after_bytes=1025, seconds=60),
]


def _dcp_trainer_killed(rank: int, world: int, root: str) -> None:
    queue = AsyncCallsQueue()
    _dcp_save(queue, _state(rank, 10), FileSystemWriterAsync(f"{root}/iter_0000010"))
    path = f"{root}/iter_0000020"
    _dcp_save(queue, _state(rank, 20), FaultyWriter(path, thread_count=1, faults=_KILL_MID_WRITE))
    raise AssertionError("the trainer outlived its save of iteration 20")


def _dcp_trainer_resumes(rank: int, world: int, root: str) -> tuple[str | None, bool]:
    """The fault-tolerance guide's recipe: the newest committed checkpoint, loaded."""
    latest = latest_checkpoint(root)
    state = {f"rank{rank}": torch.empty(256, 64), "iteration": -1}
    dcp.load(state, checkpoint_id=latest)
    expected = _state(rank, 10)
    exact = torch.equal(state[f"rank{rank}"], expected[f"rank{rank}"])
    queue = AsyncCallsQueue()
    _dcp_save(queue, _state(rank, 30), FileSystemWriterAsync(f"{root}/iter_0000030"))
    queue.close()
    return latest, exact and state["iteration"] == 10


def _temp_files(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if parse_temp_name(n) is not None)


def _wait_writers_gone(directory: str) -> None:
    pids = [parse_temp_name(n).pid for n in _temp_files(directory)]  # type: ignore[union-attr]
    survivors, _ = wait_gone(pids, WORKER_GONE_S)
    assert not survivors, f"writer(s) {survivors} outlived their trainer"


def _ls(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, dict]]:
    code = main(["--json", "ls", *argv])
    return code, {e["path"]: e for e in json.loads(capsys.readouterr().out)}


def test_a_killed_async_dcp_save_is_seen_resumed_past_and_pruned(tmp_path, capsys) -> None:
    root = str(tmp_path / "ckpt")
    # A rank killed, or one that saw its peer die first (gloo: connection reset).
    with pytest.raises(RankFailure):
        launch(_dcp_trainer_killed, 2, root, timeout=120)
    killed = os.path.join(root, "iter_0000020")
    assert ".metadata" not in os.listdir(killed)
    assert _temp_files(killed), os.listdir(killed)  # the killing worker's file, at least
    _wait_writers_gone(killed)

    code, entries = _ls(capsys, root)
    assert code == 0 and entries[os.path.join(root, "iter_0000010")]["complete"]
    assert entries[killed]["complete"] is False and entries[killed]["kind"] == "dcp"
    assert entries[killed]["committed"] is False
    assert entries[killed]["problems"][0].startswith("not committed (incomplete)")
    assert main(["verify", root]) == 1 and "not committed" in capsys.readouterr().out
    assert latest_checkpoint(root) == os.path.join(root, "iter_0000010")
    assert main(["prune", root]) == 0  # iteration 20 may be a save in progress: kept
    assert sorted(os.listdir(root)) == ["iter_0000010", "iter_0000020"]
    capsys.readouterr()

    results = launch(_dcp_trainer_resumes, 2, root, timeout=120)
    assert results == [(os.path.join(root, "iter_0000010"), True)] * 2
    assert main(["prune", root]) == 0
    assert "2 checkpoint(s) deleted" in capsys.readouterr().out
    assert os.listdir(root) == ["iter_0000030"]
    assert latest_checkpoint(root) == os.path.join(root, "iter_0000030")


# Each rank's worker SIGKILLs its trainer as it opens its data file, before creating it.
_KILL_AT_OPEN = [
    Fault(Phase.OPEN_WRITE, Action.KILL_PARENT, match="*.distcp"),
    Fault(Phase.OPEN_WRITE, Action.DELAY, match="*.distcp", seconds=60),
]


def _dcp_trainer_killed_at_open(rank: int, world: int, root: str) -> None:
    queue = AsyncCallsQueue()
    _dcp_save(queue, _state(rank, 10), FileSystemWriterAsync(f"{root}/iter_0000010"))
    path = f"{root}/iter_0000020"
    _dcp_save(queue, _state(rank, 20), FaultyWriter(path, thread_count=1, faults=_KILL_AT_OPEN))
    raise AssertionError("the trainer outlived its save of iteration 20")


def _dcp_trainer_saves_30(rank: int, world: int, root: str) -> None:
    queue = AsyncCallsQueue()
    _dcp_save(queue, _state(rank, 30), FileSystemWriterAsync(f"{root}/iter_0000030"))
    queue.close()


def test_a_save_killed_before_its_first_file_leaves_an_empty_directory_that_is_seen(
    tmp_path, capsys
) -> None:
    root = str(tmp_path / "ckpt")
    with pytest.raises(RankFailure):
        launch(_dcp_trainer_killed_at_open, 2, root, timeout=120)
    killed = os.path.join(root, "iter_0000020")
    assert os.listdir(killed) == []  # made at planning, in the trainer; no file opened
    code, entries = _ls(capsys, root)
    assert code == 0 and entries[killed]["complete"] is False
    assert "it is empty" in entries[killed]["problems"][0]
    assert latest_checkpoint(root) == os.path.join(root, "iter_0000010")
    launch(_dcp_trainer_saves_30, 2, root, timeout=120)
    assert main(["prune", root]) == 0 and os.listdir(root) == ["iter_0000030"]


class KillsTrainerWhenSaved:
    """A state value whose pickling in the worker's ``torch.save`` (after the temporary file
    was opened) SIGKILLs the trainer. Pickled in the trainer first (to reach the worker),
    where it only arms itself with the trainer's pid: the copy the worker unpickles kills
    that process, while it is still the worker's parent (never one that adopted it)."""

    def __init__(self, trainer: int | None = None) -> None:
        self.trainer = trainer

    def __reduce__(self):  # type: ignore[no-untyped-def]
        if self.trainer is not None:
            if os.getppid() == self.trainer:
                os.kill(self.trainer, signal.SIGKILL)
            time.sleep(60)  # dies of its parent's death
        return (KillsTrainerWhenSaved, (os.getpid(),))


def _torch_trainer_killed(rank: int, world: int, folder: str) -> None:
    ckpt = TorchAsyncCheckpoint()
    ckpt.async_save(_state(rank, 10), os.path.join(folder, "step_10.pt"))
    ckpt.finalize_async_save(blocking=True)
    state = {**_state(rank, 20), "trap": KillsTrainerWhenSaved()}
    ckpt.async_save(state, os.path.join(folder, "step_20.pt"))
    ckpt.finalize_async_save(blocking=True)
    raise AssertionError("the trainer outlived its save of step 20")


def test_a_killed_torch_save_leaves_a_temporary_file_that_the_next_save_removes(
    tmp_path, capsys
) -> None:
    folder = str(tmp_path / "ckpt")
    os.makedirs(folder)
    with pytest.raises(RankFailure, match="exit code -9"):
        launch(_torch_trainer_killed, 1, folder, timeout=120, process_group=False)
    (temp,) = _temp_files(folder)
    assert parse_temp_name(temp).final == "step_20.pt"  # type: ignore[union-attr]
    assert sorted(os.listdir(folder)) == sorted([temp, "step_10.pt"])
    _wait_writers_gone(folder)

    code, entries = _ls(capsys, folder)
    left = entries[os.path.join(folder, temp)]
    assert code == 0 and left["kind"] == "temp" and left["complete"] is False
    assert left["iteration"] == 20 and "is gone" in left["problems"][0]
    assert entries[os.path.join(folder, "step_10.pt")]["complete"]
    code, entries = _ls(capsys, folder, "--verify")
    assert code == 1 and entries[os.path.join(folder, temp)]["verified"] is False
    assert latest_checkpoint(folder) == os.path.join(folder, "step_10.pt")
    assert torch.equal(torch.load(latest_checkpoint(folder))["rank0"], _state(0, 10)["rank0"])

    ckpt = TorchAsyncCheckpoint(persistent_queue=False)
    ckpt.async_save(_state(0, 30), os.path.join(folder, "step_30.pt"))
    ckpt.finalize_async_save(blocking=True, terminate=True)
    assert sorted(os.listdir(folder)) == ["step_10.pt", "step_30.pt"]
