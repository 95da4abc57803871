"""The resilient-ckpt command on real checkpoints written by the library and by plain DCP."""

from __future__ import annotations

import json
import os
import shlex

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
from tests._helpers import flip_byte

pytestmark = pytest.mark.dist


def _state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=gen), "b": torch.zeros(32, dtype=torch.float64)}


def _save_local(rank: int, world: int, root: str) -> None:
    repl = CliqueReplicationStrategy.from_replication_params(
        replication_jump=1, replication_factor=2
    )
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
    return {
        "root": str(root),
        "ours": ours,
        "plain": plain,
        "torn": torn,
        "file": torch_file,
        "local": os.path.join(local_root, "s"),
    }


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


def test_ls_lists_every_kind(ckpts, capsys) -> None:
    code, out = _run(capsys, "--json", "ls", ckpts["root"], "--verify")
    assert code == 1  # the torn checkpoint's row fails
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
    # A local checkpoint's state is read in the managers' safe mode, or in full with --trust.
    for trust in ([], ["--trust"]):
        code, out = _run(capsys, "--json", "inspect", ckpts["local"], *trust)
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
    for trust in ([], ["--trust"]):
        local_out = str(tmp_path / f"local{len(trust)}.pt")
        assert _run(capsys, "convert", ckpts["local"], local_out, *trust)[0] == 0
        merged = torch.load(local_out)
        assert torch.equal(merged["rank1"]["model"]["w"], _state(1)["w"])
    code = main(["convert", ckpts["torn"], str(tmp_path / "x.pt")])
    assert code == 1 and "not committed" in capsys.readouterr().err


def test_verify_detects_damage_and_names_the_file(ckpts, capsys, tmp_path) -> None:
    assert _run(capsys, "verify", ckpts["ours"])[0] == 0
    assert _run(capsys, "verify", ckpts["local"])[0] == 0
    data = sorted(n for n in os.listdir(ckpts["ours"]) if n.endswith(".distcp"))[0]
    flip_byte(os.path.join(ckpts["ours"], data))
    code, out = _run(capsys, "--json", "verify", ckpts["ours"])
    report = json.loads(out)
    assert code == 1 and report["ok"] is False
    assert data in " ".join(report["checkpoints"][0]["problems"])
    victim = os.path.join(ckpts["local"], "1", "iter_0000007_1_local.pt")
    flip_byte(victim)
    code, out = _run(capsys, "verify", ckpts["local"])
    assert code == 1 and victim in out and "checksum" in out
    code = main(["verify", str(tmp_path / "nothing")])
    assert code == 1


def test_bench_rejects_unknown_benchmark(capsys) -> None:
    assert main(["bench", "--only", "no_such_bench"]) == 2


def _copy(src: str, tmp_path) -> str:
    import shutil

    dst = str(tmp_path / os.path.basename(src))
    shutil.copytree(src, dst)
    return dst


def test_verify_plain_dcp_checks_sizes_and_reads_items_back(ckpts, capsys, tmp_path) -> None:
    plain = _copy(ckpts["plain"], tmp_path)
    code, out = _run(capsys, "verify", plain, "--json")  # --json after the verb too
    report = json.loads(out)
    assert code == 0 and report["ok"] and report["checkpoints"][0]["checks"] == "read"
    code, text = _run(capsys, "verify", plain)
    assert code == 0 and "no checksums recorded" in text and "1 checkpoint(s) checked" in text
    data = sorted(n for n in os.listdir(plain) if n.endswith(".distcp"))[0]
    with open(os.path.join(plain, data), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(plain, data)) // 2)
    code, out = _run(capsys, "--json", "verify", plain)
    problems = " ".join(json.loads(out)["checkpoints"][0]["problems"])
    assert code == 1 and data in problems and "bytes" in problems


def test_verify_tree_reports_each_checkpoint(ckpts, capsys, tmp_path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    ours = _copy(ckpts["plain"], tree)
    torn = _copy(ckpts["torn"], tree)
    code, out = _run(capsys, "--json", "verify", str(tree))
    by_path = {c["path"]: c for c in json.loads(out)["checkpoints"]}
    assert code == 1 and by_path[ours]["ok"] and not by_path[torn]["ok"]
    (problem,) = by_path[torn]["problems"]
    assert problem.startswith("not committed (incomplete): no .metadata")
    bad_file = str(tree / "broken.pt")
    with open(bad_file, "wb") as f:
        f.write(b"not a checkpoint")
    code = main(["verify", str(tree)])  # every checkpoint reported, the bad file named
    captured = capsys.readouterr()
    assert code == 2 and "FAILED" in captured.out and "3 checkpoint(s) checked" in captured.out
    prefix = f"resilient-ckpt verify: error: {bad_file}: not a torch.save file"
    assert captured.err.startswith(prefix) and captured.err.count("\n") == 1


def test_progress_counts_every_byte_verified(ckpts, tmp_path) -> None:
    from resilient_ckpt.cli import checkpoints

    fresh = str(tmp_path / "fresh")
    dcp.save(_state(5), storage_writer=FileSystemWriterAsync(fresh))
    seen: list[int] = []
    reports = checkpoints.verify_all(fresh, progress=seen.append)
    data = sum(os.path.getsize(os.path.join(fresh, n)) for n in os.listdir(fresh) if ".distcp" in n)
    assert reports[0].ok and reports[0].checks == "crc32" and sum(seen) == data
    seen.clear()
    assert all(r.ok for r in checkpoints.verify_all(ckpts["file"], progress=seen.append))
    assert sum(seen) == os.path.getsize(ckpts["file"])


def test_convert_plain_dcp_and_into_verifiable_dcp(ckpts, capsys, tmp_path) -> None:
    out_file = str(tmp_path / "plain.pt")
    code, out = _run(capsys, "--json", "convert", ckpts["plain"], out_file, "--no-progress")
    result = json.loads(out)
    assert code == 0 and result["conversion"] == "dcp -> torch.save"
    assert result["bytes"] == os.path.getsize(out_file)
    state = torch.load(out_file)
    assert torch.equal(state["w"], _state(1)["w"]) and state["b"].dtype == torch.float64
    back = str(tmp_path / "as_dcp")
    assert _run(capsys, "convert", ckpts["file"], back)[0] == 0
    code, out = _run(capsys, "--json", "verify", back)
    checked = json.loads(out)["checkpoints"][0]
    assert code == 0 and checked["checks"] == "crc32"  # our writer records checksums
    code = main(["convert", ckpts["file"], back])  # a DCP checkpoint needs its own directory
    assert code == 1 and "not an empty directory" in capsys.readouterr().err


@pytest.mark.timeout(150)
def test_bench_json_and_plot(capsys, tmp_path) -> None:
    png = str(tmp_path / "bench.png")
    argv = ["--json", "bench", "--only", "local_ckpt", "--dir", str(tmp_path), "--plot", png]
    code = main([*argv, "--", "--ranks", "2", "--size-mib", "1", "--repeats", "1"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-2000:]
    (document,) = json.loads(captured.out)
    metrics = {f["metric"] for f in document["figures"]}
    assert document["benchmark"] == "local_ckpt" and metrics == {"stall", "throughput"}
    for figure in document["figures"]:
        assert figure["value"] > 0 and figure["reference_value"] > 0
    assert "raw read" in captured.err  # the table, on stderr with --json
    assert os.listdir(tmp_path) == ["bench.png"]  # measured under --dir, cleaned up
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(png) > 10_000


def test_prune_keeps_newest_committed_and_saves_in_progress(capsys, tmp_path) -> None:
    root = tmp_path / "run"
    for it in (10, 20, 30):
        dcp.save(_state(it), checkpoint_id=str(root / f"iteration-{it:04d}"))
    failed = root / "iteration-0015"  # an older save that never committed
    dcp.save(_state(15), checkpoint_id=str(failed))
    os.unlink(failed / ".metadata")
    running = root / "iteration-0040"  # newer than every commit: may still be writing
    dcp.save(_state(40), checkpoint_id=str(running))
    os.unlink(running / ".metadata")

    code, out = _run(capsys, "--json", "prune", str(root), "--keep", "2", "--dry-run")
    expected = sorted(str(root / n) for n in ("iteration-0010", "iteration-0015"))
    assert code == 0 and sorted(json.loads(out)["would_delete"]) == expected
    assert json.loads(out)["deleted"] == [] and (root / "iteration-0010").exists()

    code, out = _run(capsys, "prune", str(root), "--keep", "2")
    assert code == 0 and "2 checkpoint(s) deleted" in out
    assert sorted(os.listdir(root)) == ["iteration-0020", "iteration-0030", "iteration-0040"]
    code, _ = _run(capsys, "verify", str(root / "iteration-0020"))
    assert code == 0

    code = main(["prune", str(root), "--keep", "0"])
    assert code == 1 and "keep_latest must be an int >= 1" in capsys.readouterr().err


def test_bench_stall_refuses_to_skip_the_reference(capsys) -> None:
    from resilient_ckpt.cli import bench_stall

    with pytest.raises(SystemExit):
        bench_stall.main(["--skip", "memcpy"])  # the reference every ratio needs
    assert "required flow(s) ['memcpy']" in capsys.readouterr().err


def test_a_local_copy_file_alone_is_checked_never_unpickled(ckpts, capsys, tmp_path) -> None:
    session = _copy(ckpts["local"], tmp_path)
    shard = os.path.join(session, "0", "iter_0000007_0_local.pt")
    code, out = _run(capsys, "--json", "ls", shard, "--verify")
    (entry,) = json.loads(out)
    assert code == 0 and entry["kind"] == "local" and entry["complete"] and entry["verified"]
    assert entry["checks"] == "crc32"
    os.unlink(os.path.join(session, "0", "iter_0000007_0_local.manifest.json"))
    code, out = _run(capsys, "--json", "ls", shard)
    (entry,) = json.loads(out)
    assert not entry["complete"] and "not committed" in entry["problems"][0]
    code = main(["inspect", shard, "--trust"])
    assert code == 2 and "not committed" in capsys.readouterr().err


@pytest.mark.timeout(150)
def test_bench_markdown_tables_for_the_docs(capsys, tmp_path) -> None:
    # The smallest stall run there is: one rank, the 2 MB shape, one repetition.
    extra = ["--ranks", "1", "--shapes", "2M/64", "--reps", "1", "--warmups", "0"]
    extra += ["--first-trials", "1", "--memory-saves", "0", "--gap-ms", "0"]
    # One run also checks --skip: the flows named are left out of every table.
    skipped = ["ours DCP overlapped+defer", "ours local overlapped+defer"]
    extra += ["--skip", ",".join(skipped)]
    argv = ["bench", "--markdown", "--only", "stall", "--dir", str(tmp_path), "--", *extra]
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 0, captured.err[-2000:]
    lines = captured.out.splitlines()
    assert lines[0] == f"Command: `resilient-ckpt {shlex.join(argv)}`"
    assert lines[2].startswith(f"Machine: {os.cpu_count()} CPUs") and "torch " in lines[2]
    rows = {
        cells[1]: cells
        for line in lines
        if line.startswith("| 2M/64")
        for cells in [[c.strip() for c in line.strip()[1:-1].split("|")]]
    }
    ours = rows["ours torch"]  # case, figure, value, reference, ref value, ratio, target, peer
    assert ours[3] == "memcpy" and ours[6] == "<= 3 ms + 2x" and ours[7] == "dcp.async_save"
    value, copy = (float(ours[i].split()[0]) for i in (2, 4))  # ms, rounded to 0.01
    assert float(ours[5].rstrip("x")) == pytest.approx(value / copy, rel=0.05, abs=0.01)
    assert ours[8].endswith("x")
    assert {"ours DCP", "ours local", "dcp.async_save", "ours torch, overlapped call"} <= set(rows)
    assert "Stall per save at 1 ranks" in captured.err  # the printed tables, on stderr
    assert not {
        "ours DCP, overlapped call, deferred planning",
        "ours local, overlapped call, deferred planning",
    } & set(rows), rows
    printed = {
        line[11:39].strip() for line in captured.err.splitlines() if line.startswith("2M/64")
    }
    assert "ours DCP overlapped" in printed and not printed & set(skipped), printed
    finalize = captured.err[captured.err.index("Finalize in the trainer") :].splitlines()[1:4]
    assert [line[11:39].strip() for line in finalize] == ["ours DCP", "ours torch", "ours local"]
    assert os.listdir(tmp_path) == []
