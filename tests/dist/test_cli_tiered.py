"""The resilient-ckpt command on both tiers of a checkpoint written by TieredCheckpointManager."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from resilient_ckpt.cli import main
from resilient_ckpt.testing import launch
from tests._helpers import flip_byte

pytestmark = pytest.mark.dist


def _state(rank: int, step: int) -> dict:
    # Keys name the rank so that each rank writes a shard of its own (plain tensors under a
    # shared key would be written by one rank only).
    gen = torch.Generator().manual_seed(100 * step + rank)
    return {"model": {f"rank{rank}.w": torch.randn(64, 32, generator=gen)}, "step": step}


def _save(rank: int, world: int, memory: str, durable: str) -> None:
    from resilient_ckpt.tiered import TieredCheckpointManager

    manager = TieredCheckpointManager(memory, durable, replication_jump=1, durable_every=2)
    for step in (1, 2):
        manager.save(_state(rank, step), step, durable=step == 2)
        manager.maybe_finalize(blocking=True)
    manager.close()


@pytest.fixture()
def tiers(tmp_path) -> tuple[str, str]:
    memory, durable = str(tmp_path / "memory"), str(tmp_path / "durable")
    launch(_save, 2, memory, durable, timeout=150)
    return memory, durable


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


@pytest.mark.timeout(180)
def test_ls_inspect_verify_show_both_tiers(tiers, capsys) -> None:
    memory, durable = tiers
    code, out = _run(capsys, "--json", "ls", memory, durable, "--verify")
    assert code == 0
    entries = json.loads(out)
    memory_steps = {e["iteration"]: e for e in entries if e["kind"] == "memory"}
    assert sorted(memory_steps) == [1, 2]
    for entry in memory_steps.values():
        assert entry["path"] == memory and entry["world_size"] == 2
        assert entry["complete"] and entry["verified"] and entry["checks"] == "crc32"
    # Two ranks' shards, each in its owner's directory and in its peer's.
    assert memory_steps[2]["nbytes"] > 4 * 64 * 32 * 4
    (durable_entry,) = [e for e in entries if e["kind"] == "dcp"]
    assert durable_entry["iteration"] == 2 and durable_entry["verified"]
    code, text = _run(capsys, "ls", memory, durable)
    assert code == 0 and "memory" in text and "dcp" in text

    code, out = _run(capsys, "--json", "inspect", memory)
    tensors = {t["key"]: t for t in json.loads(out)}
    assert code == 0 and tensors["model.rank1.w"]["shape"] == [64, 32]

    # A lost node: its copies are gone, the peers' copies still make every step complete.
    shutil.rmtree(os.path.join(memory, "1"))
    code, out = _run(capsys, "verify", memory, durable)
    assert code == 0 and "3 checkpoint(s) checked, 0 failed" in out
    # A flipped byte in the only remaining copy of rank 1's shard: named, and a failure.
    victim = os.path.join(memory, "0", "step_000000002", "__1_0.distcp")
    flip_byte(victim)
    code, out = _run(capsys, "verify", memory)
    assert code == 1 and victim in out and "CRC32" in out
    code, out = _run(capsys, "--json", "ls", memory, "--verify")
    by_step = {e["iteration"]: e for e in json.loads(out)}
    assert by_step[1]["verified"] and by_step[2]["verified"] is False


@pytest.mark.timeout(180)
def test_convert_takes_the_memory_tiers_newest_committed_step(tiers, capsys, tmp_path) -> None:
    memory, _ = tiers
    out_file = str(tmp_path / "memory.pt")
    code, out = _run(capsys, "--json", "convert", memory, out_file)
    assert code == 0 and "step 2" in json.loads(out)["conversion"]
    state = torch.load(out_file)
    assert state["step"] == 2
    for rank in (0, 1):
        assert torch.equal(
            state["model"][f"rank{rank}.w"], _state(rank, 2)["model"][f"rank{rank}.w"]
        )
    # A damaged copy with an intact replica: the replica is read, as on restore.
    flip_byte(os.path.join(memory, "1", "step_000000002", "__1_0.distcp"))
    os.unlink(out_file)
    assert _run(capsys, "convert", memory, out_file)[0] == 0
    assert torch.equal(torch.load(out_file)["model"]["rank1.w"], _state(1, 2)["model"]["rank1.w"])
    # The only copy left is damaged: refused, named, unless told to go on.
    shutil.rmtree(os.path.join(memory, "1"))
    flip_byte(os.path.join(memory, "0", "step_000000002", "__1_0.distcp"))
    os.unlink(out_file)
    code = main(["convert", memory, out_file])
    err = capsys.readouterr().err
    assert code == 1 and "__1_0.distcp" in err and "--ignore-checksums" in err
    assert not os.path.exists(out_file)
    code = main(["convert", memory, out_file, "--ignore-checksums"])
    assert code == 0 and "warning" in capsys.readouterr().err and os.path.exists(out_file)
    # The step ls lists as newest complete: step 1 once step 2 lost its commit records.
    for rank_dir in os.listdir(memory):
        os.unlink(os.path.join(memory, rank_dir, "step_000000002", ".metadata"))
    os.unlink(out_file)
    code, out = _run(capsys, "--json", "convert", memory, out_file)
    assert code == 0 and "step 1" in json.loads(out)["conversion"]
    assert torch.load(out_file)["step"] == 1
