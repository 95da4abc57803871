"""The resilient-ckpt command on real checkpoints written by the library and by plain DCP."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from resilient_ckpt.cli import main
from resilient_ckpt.local import (
    BasicTensorAwareStateDict,
    CliqueReplicationStrategy,
    LocalCheckpointManager,
)
from resilient_ckpt.testing import launch

pytestmark = pytest.mark.dist


def _state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=gen), "b": torch.zeros(32, dtype=torch.float64)}


def _save_local(rank: int, world: int, root: str) -> None:
    repl = CliqueReplicationStrategy.from_replication_params(replication_jump=1,
                                                             replication_factor=2)
    manager = LocalCheckpointManager(root, session_id="s", repl_strategy=repl)
    manager.save(BasicTensorAwareStateDict({"model": _state(rank)}), 7)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cli")
    ours = str(root / "dcp" / "iter_0000010")
    dcp.save(_state(0), storage_writer=FileSystemWriterAsync(ours))
    plain = str(root / "dcp" / "plain_0000020")
    dcp.save(_state(1), checkpoint_id=plain)
    torn = str(root / "dcp" / "torn_0000030")
    dcp.save(_state(2), checkpoint_id=torn)
    os.unlink(os.path.join(torn, ".metadata"))  # data without its commit record
    torch_file = str(root / "files" / "model.pt")
    os.makedirs(os.path.dirname(torch_file))
    torch.save(_state(3), torch_file)
    local_root = str(root / "local")
    launch(_save_local, 2, local_root, timeout=120)
    return {"root": str(root), "ours": ours, "plain": plain, "torn": torn,
            "file": torch_file, "local": os.path.join(local_root, "s")}


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


def _flip(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_ls_lists_every_kind(ckpts, capsys) -> None:
    code, out = _run(capsys, "--json", "ls", ckpts["root"], "--verify")
    assert code == 0
    by_path = {e["path"]: e for e in json.loads(out)}
    assert by_path[ckpts["ours"]]["complete"] and by_path[ckpts["ours"]]["verified"]
    assert by_path[ckpts["ours"]]["iteration"] == 10
    assert by_path[ckpts["plain"]]["complete"] and by_path[ckpts["plain"]]["verified"]
    assert by_path[ckpts["torn"]]["complete"] is False
    assert by_path[ckpts["file"]]["kind"] == "torch"
    local = by_path[ckpts["local"]]
    assert local["kind"] == "local" and local["iteration"] == 7 and local["world_size"] == 2
    assert local["complete"] and local["verified"]
    code, text = _run(capsys, "ls", ckpts["root"])
    assert code == 0 and "iteration" in text and ckpts["torn"] in text and "NO" in text


def test_inspect_shows_keys_shapes_dtypes(ckpts, capsys) -> None:
    for path in (ckpts["ours"], ckpts["plain"], ckpts["file"]):
        code, out = _run(capsys, "--json", "inspect", path)
        tensors = {t["key"]: t for t in json.loads(out)}
        assert code == 0 and tensors["w"]["shape"] == [64, 32]
        assert tensors["b"]["dtype"] == "float64" and tensors["w"]["nbytes"] == 64 * 32 * 4
    code, out = _run(capsys, "--json", "inspect", ckpts["local"])
    keys = {t["key"] for t in json.loads(out)}
    assert code == 0 and {"rank0.model.w", "rank1.model.b"} <= keys
    code, text = _run(capsys, "inspect", ckpts["file"])
    assert "2 tensors" in text


def test_convert_round_trips(ckpts, capsys, tmp_path) -> None:
    out_file = str(tmp_path / "from_dcp.pt")
    assert _run(capsys, "convert", ckpts["ours"], out_file)[0] == 0
    assert torch.equal(torch.load(out_file)["w"], _state(0)["w"])
    back = str(tmp_path / "back_dcp")
    assert _run(capsys, "convert", out_file, back)[0] == 0
    loaded = {"w": torch.empty(64, 32), "b": torch.empty(32, dtype=torch.float64)}
    dcp.load(loaded, checkpoint_id=back)
    assert torch.equal(loaded["w"], _state(0)["w"])
    local_out = str(tmp_path / "local.pt")
    assert _run(capsys, "convert", ckpts["local"], local_out)[0] == 0
    merged = torch.load(local_out)
    assert torch.equal(merged["rank1"]["model"]["w"], _state(1)["w"])
    code = main(["convert", ckpts["torn"], str(tmp_path / "x.pt")])
    assert code == 1 and "not committed" in capsys.readouterr().err


def test_verify_detects_damage_and_names_the_file(ckpts, capsys, tmp_path) -> None:
    assert _run(capsys, "verify", ckpts["ours"])[0] == 0
    assert _run(capsys, "verify", ckpts["local"])[0] == 0
    data = sorted(n for n in os.listdir(ckpts["ours"]) if n.endswith(".distcp"))[0]
    _flip(os.path.join(ckpts["ours"], data))
    code, out = _run(capsys, "--json", "verify", ckpts["ours"])
    report = json.loads(out)
    assert code == 1 and report["ok"] is False
    assert data in " ".join(report["checkpoints"][0]["problems"])
    victim = os.path.join(ckpts["local"], "1", "iter_0000007_1_local.pt")
    _flip(victim)
    code, out = _run(capsys, "verify", ckpts["local"])
    assert code == 1 and victim in out and "checksum" in out
    code = main(["verify", str(tmp_path / "nothing")])
    assert code == 1


def test_bench_rejects_unknown_benchmark(capsys) -> None:
    assert main(["bench", "--only", "no_such_bench"]) == 2
