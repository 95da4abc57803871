"""Single-process checks of the async DCP writer: layout, threads, checksums, bad input."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultSavePlanner

from resilient_ckpt.async_ckpt.cached_metadata_filesystem_reader import (
    CachedMetadataFileSystemReader,
    clear_metadata_cache,
)
from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from resilient_ckpt.async_ckpt.state_dict_saver import (
    CheckpointMetadataCache,
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from resilient_ckpt.async_ckpt.verify import verify_checkpoint
from resilient_ckpt.errors import (
    CheckpointExistsError,
    CheckpointWriteError,
    ConfigurationError,
    CorruptCheckpointError,
    StorageError,
)
from tests._helpers import torch_serial_layout

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _state() -> dict:
    return {
        "w1": torch.arange(4096, dtype=torch.float32),
        "w2": torch.ones(64, 64, dtype=torch.bfloat16),
        "opt.m": torch.full((1000,), 2.0),
        "opt.v": torch.full((3000,), 3.0),
        "step": 7,
        "name": "model",
    }


def _zeros_like(state: dict) -> dict:
    return {k: torch.zeros_like(v) if torch.is_tensor(v) else None for k, v in state.items()}


def _save(
    state: dict, path, writer_cls=FileSystemWriterAsync, cache=None, planner=None, **kwargs
) -> None:
    writer = writer_cls(str(path), **kwargs)
    plan_ret = save_state_dict_async_plan(
        state, writer, planner=planner, enable_cache=cache is not None, metadata_cache=cache
    )
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    request = AsyncRequest(
        save_fn, args, [lambda: save_state_dict_async_finalize(*plan_ret)], preload_fn=preload_fn
    )
    request.execute_sync()


def _load(state: dict, path) -> dict:
    target = _zeros_like(state)
    dcp.load(target, checkpoint_id=str(path))
    return target


def _assert_same(a: dict, b: dict) -> None:
    for key, value in a.items():
        if torch.is_tensor(value):
            assert torch.equal(value, b[key]), key
        else:
            assert value == b[key], key


def _with_autograd_leaves(state: dict) -> dict:
    state["param"] = torch.nn.Parameter(torch.full((5,), 4.0))
    state["grad_leaf"] = torch.full((6,), 5.0, requires_grad=True)
    return state


def test_round_trip_and_byte_identical_to_torch_writer(tmp_path) -> None:
    state = _with_autograd_leaves(_state())
    state["view"] = torch.arange(100.0)[10:30]
    with warnings.catch_warnings(), torch_serial_layout():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "ref")))
    _save(state, tmp_path / "ours", thread_count=1)
    ours = (tmp_path / "ours" / "__0_0.distcp").read_bytes()
    assert ours == (tmp_path / "ref" / "__0_0.distcp").read_bytes()
    _assert_same(state, _load(state, tmp_path / "ours"))
    assert sorted(os.listdir(tmp_path / "ours")) == [".metadata", "__0_0.distcp"]
    report = verify_checkpoint(str(tmp_path / "ours"))
    assert report.checksummed and report.files == {"__0_0.distcp": len(ours)}


@pytest.mark.timeout(120)
def test_staged_saves_are_byte_identical_to_torch_writer(tmp_path) -> None:
    """Through the worker (staged; the second save takes the steady-state paths), plain
    tensors, Parameters and tensors requiring grad are written as torch's writer does."""
    state = _with_autograd_leaves(_state())
    with warnings.catch_warnings(), torch_serial_layout():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "ref")))
    reference = (tmp_path / "ref" / "__0_0.distcp").read_bytes()
    queue = AsyncCallsQueue()
    cache = CheckpointMetadataCache()
    try:
        for n in range(2):
            writer = FileSystemWriterAsync(str(tmp_path / f"ours{n}"), thread_count=1)
            plan_ret = save_state_dict_async_plan(
                state, writer, enable_cache=True, metadata_cache=cache
            )
            save_fn, preload_fn, args = writer.get_save_function_and_args()
            finalize = [lambda r=plan_ret: save_state_dict_async_finalize(*r)]
            queue.schedule_async_request(
                AsyncRequest(save_fn, args, finalize, preload_fn=preload_fn)
            )
            queue.maybe_finalize_async_calls(blocking=True)
            assert (tmp_path / f"ours{n}" / "__0_0.distcp").read_bytes() == reference, n
            # The worker's write results came back over its channel, not as a file.
            assert sorted(os.listdir(tmp_path / f"ours{n}")) == [".metadata", "__0_0.distcp"]
    finally:
        queue.close()


class _BarrierWriter(FileSystemWriterAsync):
    """Every writer thread waits for all the others: passes only if they run at once."""

    barrier = threading.Barrier(3, timeout=30)
    thread_names: set[str] = set()

    @classmethod
    def write_preloaded_data(cls, job, write_bucket):
        cls.thread_names.add(threading.current_thread().name)
        cls.barrier.wait()
        return super().write_preloaded_data(job, write_bucket)


def test_writer_threads_run_in_parallel_and_balance_bytes(tmp_path) -> None:
    state = {f"t{i}": torch.full((1000 * (i + 1),), float(i)) for i in range(6)}
    _save(state, tmp_path / "ck", writer_cls=_BarrierWriter, thread_count=3)
    assert len(_BarrierWriter.thread_names) == 3
    sizes = [os.path.getsize(tmp_path / "ck" / f"__0_{k}.distcp") for k in range(3)]
    assert max(sizes) < 1.2 * min(sizes)
    _assert_same(state, _load(state, tmp_path / "ck"))


def test_separation_hint_and_file_per_item(tmp_path) -> None:
    state = _state()
    _save(state, tmp_path / "hint", thread_count=4, separation_hint="opt.")
    metadata = dcp.FileSystemReader(str(tmp_path / "hint")).read_metadata()
    for index, info in metadata.storage_data.items():
        assert info.relative_path.startswith("opt.") == index.fqn.startswith("opt."), index
    _assert_same(state, _load(state, tmp_path / "hint"))

    _save(state, tmp_path / "per_item", single_file_per_rank=False, thread_count=2)
    names = [n for n in os.listdir(tmp_path / "per_item") if n.endswith(".distcp")]
    assert len(names) == len(state)
    _assert_same(state, _load(state, tmp_path / "per_item"))


@pytest.mark.parametrize("sync_files", [True, False])
def test_sync_files_controls_fsync(tmp_path, monkeypatch, sync_files) -> None:
    calls = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real_fsync(fd)))
    _save(_state(), tmp_path / "ck", thread_count=2, sync_files=sync_files)
    # two data files and .metadata (each also fsyncs its directory)
    assert (len(calls) >= 6) if sync_files else (calls == [])


def test_flipped_byte_truncation_and_missing_commit_are_detected(tmp_path) -> None:
    state = _state()
    _save(state, tmp_path / "ck", thread_count=2)
    data = tmp_path / "ck" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match=r"__0_0\.distcp: CRC32"):
        verify_checkpoint(str(tmp_path / "ck"))
    verify_checkpoint(str(tmp_path / "ck"), checksums=False)  # sizes still right
    data.write_bytes(bytes(raw[:-10]))
    with pytest.raises(CorruptCheckpointError, match="bytes, .* were written"):
        verify_checkpoint(str(tmp_path / "ck"), checksums=False)
    os.unlink(tmp_path / "ck" / "__0_1.distcp")
    with pytest.raises(CorruptCheckpointError, match="__0_1.distcp: missing"):
        verify_checkpoint(str(tmp_path / "ck"))
    os.unlink(tmp_path / "ck" / ".metadata")
    with pytest.raises(CorruptCheckpointError, match="not a committed checkpoint"):
        verify_checkpoint(str(tmp_path / "ck"))


def test_bad_input_gets_named_errors(tmp_path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ConfigurationError, match="not a directory"):
        FileSystemWriterAsync(str(a_file))
    with pytest.raises(ConfigurationError, match="thread_count"):
        FileSystemWriterAsync(str(tmp_path / "ck"), thread_count=0)
    with pytest.raises(ConfigurationError, match="StorageWriter"):
        save_state_dict_async_plan(_state(), object())
    with pytest.raises(ConfigurationError, match="cannot write asynchronously"):
        save_state_dict_async_plan(_state(), dcp.FileSystemWriter(str(tmp_path / "ck")))
    with pytest.raises(ConfigurationError, match="key 1 is a int"):
        save_state_dict_async_plan({1: torch.ones(1)}, FileSystemWriterAsync(str(tmp_path)))
    writer = FileSystemWriterAsync(str(tmp_path / "never"))
    with pytest.raises(CheckpointWriteError, match="before prepare_write_data"):
        writer.retrieve_write_results()


@pytest.fixture
def unwritable_dir(tmp_path):
    path = tmp_path / "locked"
    path.mkdir()
    if os.geteuid() == 0:
        if shutil.which("chattr") is None:
            pytest.skip("running as root without chattr: cannot make a directory unwritable")
        done = subprocess.run(["chattr", "+i", str(path)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"chattr +i not supported here: {done.stderr!r}")
        yield path
        subprocess.run(["chattr", "-i", str(path)], check=True)
    else:
        path.chmod(0o500)
        yield path
        path.chmod(0o700)


def test_unwritable_directory_is_a_storage_error(unwritable_dir) -> None:
    for target in (unwritable_dir, unwritable_dir / "new" / "ckpt"):
        with pytest.raises(StorageError, match="not writable"):
            FileSystemWriterAsync(str(target))


def test_a_parent_directory_is_probed_once_and_a_failed_probe_never_remembered(
    tmp_path, monkeypatch
) -> None:
    import tempfile

    from resilient_ckpt.storage import posix

    probes: list[str] = []
    mkstemp = tempfile.mkstemp

    def counting(*args, **kwargs):
        probes.append(kwargs["dir"])
        return mkstemp(*args, **kwargs)

    monkeypatch.setattr(posix.tempfile, "mkstemp", counting)
    for step in range(3):  # a writer per save, each in a new directory under one parent
        FileSystemWriterAsync(str(tmp_path / f"iter_{step}"))
    assert probes == [str(tmp_path)]
    (tmp_path / "iter_0").mkdir()
    FileSystemWriterAsync(str(tmp_path / "iter_0"))  # an existing directory is its own probe
    assert probes == [str(tmp_path), str(tmp_path / "iter_0")]

    def failing(*args, **kwargs):
        probes.append(kwargs["dir"])
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(posix.tempfile, "mkstemp", failing)
    (tmp_path / "other").mkdir()
    for _ in range(2):
        with pytest.raises(StorageError, match="not writable"):
            FileSystemWriterAsync(str(tmp_path / "other" / "ckpt"))
    assert probes[-2:] == [str(tmp_path / "other")] * 2


def test_overwrite_uncommits_first_and_can_be_refused(tmp_path) -> None:
    state = _state()
    _save(state, tmp_path / "ck")
    state["w1"].add_(1)
    _save(state, tmp_path / "ck")
    _assert_same(state, _load(state, tmp_path / "ck"))
    with pytest.raises(CheckpointException) as info:
        _save(state, tmp_path / "ck", overwrite=False)
    assert isinstance(info.value.failures[0][0], CheckpointExistsError)


def test_saves_through_the_plan_cache_load_exactly_after_every_structure_change(tmp_path) -> None:
    cache = CheckpointMetadataCache()
    state = _state()
    for i in range(3):
        state["w1"].add_(1)
        _save(state, tmp_path / f"ck{i}", cache=cache)
        _assert_same(state, _load(state, tmp_path / f"ck{i}"))
    assert cache.get_metadata_caching_status() == (True, False)
    changes = {
        "new key": lambda s: s.__setitem__("extra", torch.ones(3)),
        "new shape": lambda s: s.__setitem__("w1", torch.zeros(10)),
        "new dtype": lambda s: s.__setitem__("w2", s["w2"].float()),
        "tensor to object": lambda s: s.__setitem__("opt.m", [1, 2]),
    }
    for n, change in enumerate(changes.values()):
        change(state)
        _save(state, tmp_path / f"changed{n}", cache=cache)
        _assert_same(state, _load(state, tmp_path / f"changed{n}"))
        state["w1"].add_(1)  # and the steady save after the change
        _save(state, tmp_path / f"steady{n}", cache=cache)
        _assert_same(state, _load(state, tmp_path / f"steady{n}"))


def test_cached_reader_is_never_served_a_rewritten_directory_stale(tmp_path) -> None:
    """Read through the metadata cache, a checkpoint rewritten in place (another structure)
    loads as the new one, cached or not, and after the cache is cleared. (That unchanged
    reads are served from the cache is in ``test_performance_contract.py``.)"""
    clear_metadata_cache()
    path = tmp_path / "ck"
    first = {"a": torch.ones(4)}
    _save(first, path)
    for _ in range(3):
        target = {"a": torch.zeros(4)}
        dcp.load(target, storage_reader=CachedMetadataFileSystemReader(str(path)))
        assert torch.equal(target["a"], first["a"])
    second = {"a": torch.full((4,), 5.0), "b": torch.ones(2)}
    _save(second, path)
    for cache_metadata in (True, False, True):
        target = {"a": torch.zeros(4), "b": torch.zeros(2)}
        reader = CachedMetadataFileSystemReader(str(path), cache_metadata=cache_metadata)
        dcp.load(target, storage_reader=reader)
        _assert_same(second, target)
    clear_metadata_cache(str(path))
    assert set(CachedMetadataFileSystemReader(str(path)).read_metadata().state_dict_metadata) == {
        "a",
        "b",
    }


def test_writer_also_works_with_dcp_save_and_torch_checkpoints_verify(tmp_path) -> None:
    state = _state()
    dcp.save(state, storage_writer=FileSystemWriterAsync(str(tmp_path / "ours"), thread_count=3))
    _assert_same(state, _load(state, tmp_path / "ours"))
    assert verify_checkpoint(str(tmp_path / "ours")).checksummed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "torch")))
    report = verify_checkpoint(str(tmp_path / "torch"))
    assert not report.checksummed and report.nbytes > 0


class _DecentralizedPlanner(DefaultSavePlanner):
    """Plans each rank on its own (as Megatron's planner does); fine for one rank."""

    can_run_decentralized_global_plan = True

    def create_decentralized_global_plan(self, local_plan):
        return local_plan


def test_decentralized_planning_reuses_loaded_metadata(tmp_path) -> None:
    state = _state()
    _save(
        state, tmp_path / "first", cache=CheckpointMetadataCache(), planner=_DecentralizedPlanner()
    )
    loaded = dcp.FileSystemReader(str(tmp_path / "first")).read_metadata()
    assert len(loaded.all_local_plans) == 1
    # the plans kept in the metadata are among what the restricted unpickler allows
    restricted = CachedMetadataFileSystemReader(str(tmp_path / "first"), cache_metadata=False)
    assert restricted.read_metadata().all_local_plans == loaded.all_local_plans
    cache = CheckpointMetadataCache()
    cache.set_cached_global_metadata(loaded)
    state["w1"].add_(5)
    _save(state, tmp_path / "second", cache=cache, planner=_DecentralizedPlanner())
    assert cache.get_metadata_caching_status() == (False, True)
    _assert_same(state, _load(state, tmp_path / "second"))
