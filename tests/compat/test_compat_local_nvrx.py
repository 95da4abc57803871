"""Local checkpoints written by NVRx are found and loaded after switching to this package.

The files are written the way NVRx's LocalCheckpointManager writes them (``torch.save`` to
``iter_<it>_<owner>_local.dirty.pt``, renamed to ``...local.pt``, in
``<root>/<session_id>/<rank>/``, no manifest), with and without replication; the rules a
file must pass to count are in ``resilient_ckpt.local._nvrx_format``.
"""

from __future__ import annotations

import os
import struct
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from resilient_ckpt.errors import CheckpointingException
from resilient_ckpt.local import _nvrx_format
from resilient_ckpt.local.basic_state_dict import BasicTensorAwareStateDict
from resilient_ckpt.local.ckpt_managers.local_manager import LocalCheckpointManager
from resilient_ckpt.local.replication.strategies import CliqueReplicationStrategy
from resilient_ckpt.testing import launch

from ._local_states import HostOnlyStateDict, write_like_nvrx, write_nvrx_basic


def _rank_dir(root: Path, rank: int = 0, session: str = "") -> Path:
    return root / session / str(rank)


def _flip_in_record(path: Path, suffix: str) -> None:
    """Flip one byte inside the data of the archive record whose name ends with ``suffix``."""
    with zipfile.ZipFile(path) as archive:
        record = next(r for r in archive.infolist() if r.filename.endswith(suffix))
    raw = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack_from("<HH", raw, record.header_offset + 26)
    start = record.header_offset + 30 + name_len + extra_len
    raw[start + record.compress_size // 2] ^= 0x01
    path.write_bytes(bytes(raw))


def test_nvrx_file_is_loaded_and_then_replaced_by_our_saves(tmp_path):
    state = HostOnlyStateDict(iteration=40, seed=1)
    expected = state.clone()
    write_like_nvrx(_rank_dir(tmp_path), 40, 0, state)
    mgr = LocalCheckpointManager(tmp_path)
    assert mgr.find_latest() == 40
    loaded, ckpt_id = mgr.load()
    assert ckpt_id == (40, 0, "")
    assert loaded.same_values(expected) and loaded.calls[-1] == "restore_tensor_device"
    # The job goes on with our format; retention removes NVRx's file once ours is committed.
    mgr.save(HostOnlyStateDict(iteration=41, seed=2), 41)
    names = sorted(os.listdir(_rank_dir(tmp_path)))
    assert [n for n in names if not n.startswith(".")] == [
        "iter_0000041_0_local.manifest.json",
        "iter_0000041_0_local.pt",
    ]


@pytest.mark.parametrize("damage", ["truncated", "flipped_tensor_byte", "not_torch", "dirty"])
def test_incomplete_or_damaged_nvrx_files_do_not_count(tmp_path, damage):
    rank_dir = _rank_dir(tmp_path)
    write_like_nvrx(rank_dir, 8, 0, HostOnlyStateDict(iteration=8, seed=3))  # older, intact
    newer = write_like_nvrx(rank_dir, 9, 0, HostOnlyStateDict(iteration=9, seed=4))
    if damage == "truncated":  # cut short: NVRx never fsyncs, a crash can leave this
        newer.write_bytes(newer.read_bytes()[: newer.stat().st_size // 2])
    elif damage == "flipped_tensor_byte":
        _flip_in_record(newer, "data/0")
    elif damage == "not_torch":
        newer.unlink()
        with zipfile.ZipFile(newer, "w") as archive:
            archive.writestr("notes.txt", "hello")
    else:  # a save interrupted before NVRx's rename
        newer.rename(newer.with_name("iter_0000009_0_local.dirty.pt"))
    mgr = LocalCheckpointManager(tmp_path)
    assert mgr.find_latest() == 8
    loaded, _ = mgr.load()
    assert loaded.iteration == 8
    left = [n for n in os.listdir(rank_dir) if not n.startswith(".")]
    assert left == ["iter_0000008_0_local.pt"]  # the bad newer file was removed


def test_our_shard_without_manifest_is_not_taken_for_nvrx(tmp_path):
    mgr = LocalCheckpointManager(tmp_path)
    mgr.save(HostOnlyStateDict(iteration=3, seed=5), 3)
    (_rank_dir(tmp_path) / "iter_0000003_0_local.manifest.json").unlink()
    assert not _nvrx_format.is_nvrx_file(str(_rank_dir(tmp_path) / "iter_0000003_0_local.pt"))
    assert LocalCheckpointManager(tmp_path).find_latest() == -1


def test_nvrx_basic_state_dict_becomes_ours(tmp_path):
    path = _rank_dir(tmp_path) / "iter_0000005_0_local.pt"
    tensors = {"w": torch.randn(4, 3), "step": [torch.tensor(5), "adam"]}
    write_nvrx_basic(path, tensors)
    raw = path.read_bytes()
    _nvrx_format.verify(raw, str(path))
    state = _nvrx_format.load_state(raw)
    assert type(state) is BasicTensorAwareStateDict and not state.is_hollow
    assert torch.equal(state.state_dict["w"], tensors["w"])
    assert state.state_dict["step"][1] == "adam"
    # NVRx's class held CUDA tensors only: they go back to CUDA, as NVRx's load does.
    assert [d.type for d in state._origin] == ["cuda", "cuda"]
    if not torch.cuda.is_available():
        mgr = LocalCheckpointManager(tmp_path)
        assert mgr.find_latest() == 5
        with pytest.raises(CheckpointingException, match="CUDA"):
            mgr.load()


@pytest.mark.gpu
def test_nvrx_basic_state_dict_loads_onto_cuda(tmp_path):
    write_nvrx_basic(_rank_dir(tmp_path) / "iter_0000005_0_local.pt", {"w": torch.ones(3)})
    mgr = LocalCheckpointManager(tmp_path)
    assert mgr.find_latest() == 5
    loaded, _ = mgr.load()
    assert loaded.state_dict["w"].is_cuda and torch.equal(
        loaded.state_dict["w"].cpu(), torch.ones(3)
    )


# -- two ranks -------------------------------------------------------------------------------


def _state(rank: int, iteration: int) -> HostOnlyStateDict:
    return HostOnlyStateDict(iteration=iteration, seed=100 * rank + iteration)


def _load(root: Path, strategy: object, session: str) -> tuple[int, HostOnlyStateDict | None]:
    mgr = LocalCheckpointManager(root, session, strategy)  # type: ignore[arg-type]
    latest = mgr.find_latest()
    if latest == -1:
        return -1, None
    state, ckpt_id = mgr.load()
    assert ckpt_id == (latest, dist.get_rank(), session)
    return latest, state


def _unreplicated(rank: int, root: Path) -> None:
    # Iteration 20 completed on both ranks; 21 only reached rank 0 (its save failed on
    # rank 1 and the job died before NVRx's finalize could delete it).
    write_like_nvrx(_rank_dir(root, rank, "job"), 20, rank, _state(rank, 20))
    if rank == 0:
        write_like_nvrx(_rank_dir(root, rank, "job"), 21, rank, _state(rank, 21))
    dist.barrier()
    latest, loaded = _load(root, None, "job")
    assert latest == 20, latest
    assert loaded is not None and loaded.same_values(_state(rank, 20))
    assert not (_rank_dir(root, rank, "job") / "iter_0000021_0_local.pt").exists()


def _replicated(rank: int, root: Path) -> None:
    # NVRx with replication (jump 1, factor 2): each rank holds both shards. Then rank 0
    # loses its directory (node replaced) before the job restarts on this package.
    for owner in (0, 1):
        write_like_nvrx(_rank_dir(root, rank, "rep"), 30, owner, _state(owner, 30))
    dist.barrier()
    if rank == 0:
        for path in _rank_dir(root, 0, "rep").iterdir():
            path.unlink()
    dist.barrier()
    strategy = CliqueReplicationStrategy.from_replication_params(1, 2)
    latest, loaded = _load(root, strategy, "rep")
    assert latest == 30
    assert loaded is not None and loaded.same_values(_state(rank, 30)), rank


def _replicas_need_replication(rank: int, root: Path) -> None:
    # Upstream's find_latest case with real files: rank 0 holds nothing, rank 1 holds both
    # shards. Without replication a rank may use only its own file, so nothing is complete.
    if rank == 1:
        for owner in (0, 1):
            write_like_nvrx(_rank_dir(root, rank, "norepl"), 10, owner, _state(owner, 10))
    dist.barrier()
    assert _load(root, None, "norepl")[0] == -1


def _two_ranks(rank: int, world_size: int, root: str) -> None:
    _unreplicated(rank, Path(root))
    _replicated(rank, Path(root))
    _replicas_need_replication(rank, Path(root))


@pytest.mark.dist
def test_nvrx_checkpoints_resume_on_two_ranks(tmp_path):
    launch(_two_ranks, 2, str(tmp_path), timeout=120)


def test_convert_reads_an_nvrx_shard(tmp_path):
    from resilient_ckpt.cli import converting as _catalog

    src = _rank_dir(tmp_path) / "iter_0000005_0_local.pt"
    tensors = {"w": torch.randn(4, 3), "step": 5}
    write_nvrx_basic(src, tensors)
    dst = tmp_path / "out.pt"
    for trusted in (False, True):  # NVRx's classes are among the safe mode's allowed ones
        assert _catalog.convert(str(src), str(dst), trusted=trusted) == "local shard -> torch.save"
        out = torch.load(dst, weights_only=False)
        assert torch.equal(out["w"], tensors["w"]) and out["step"] == 5
    _flip_in_record(src, "data/0")
    with pytest.raises(CheckpointingException, match="damaged"):
        _catalog.convert(str(src), str(tmp_path / "bad.pt"), trusted=True)
