"""NVRx behaviours of the async API that need no background worker and no process group.

Each test names the upstream test(s) of ``tests/checkpointing/unit`` in NVIDIA's
nvidia-resiliency-ext whose behaviour it checks (see docs/compat.md); the code is ours.
"""

from __future__ import annotations

import functools
import gc
import io
import os
import pickle
import threading
import time
import weakref
from collections import namedtuple
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.api import _wrap_exception as torch_wrap_exception
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.checkpoint.utils import _DistWrapper

from resilient_ckpt._torch_compat import no_dist_kwargs
from resilient_ckpt.async_ckpt import filesystem_async
from resilient_ckpt.async_ckpt._callers import AsyncCaller, LocalStatus, State, TemporalAsyncCaller
from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from resilient_ckpt.async_ckpt.state_dict_saver import (
    _find_layout_mismatch,
    save_state_dict_async_finalize,
)
from resilient_ckpt.config import Timeouts
from resilient_ckpt.errors import (
    AsyncCallFailedError,
    CheckpointTimeoutError,
    CheckpointWriteError,
    ConfigurationError,
    RemoteExceptionError,
    StagingError,
    StorageError,
    WorkerDiedError,
)
from resilient_ckpt.utils import preload_tensors

from ._async_common import (
    RecordingOpen,
    failing_open,
    prepared_writer,
    small_state,
    wait_for_file,
)

pytestmark = pytest.mark.timeout(60)


# -- _wrap_exception_for_gather (test_async_writer.py) ----------------------------------------


class _FrameWithCode:
    def __init__(self) -> None:
        self._code = (lambda: None).__code__


def test_wrap_exception_for_gather_clears_code_objects(monkeypatch) -> None:
    # What NVRx's test replaces: the module's own _wrap_exception, read at each call.
    monkeypatch.setattr(filesystem_async, "_wrap_exception", lambda exc: (exc, [_FrameWithCode()]))
    wrapped = filesystem_async._wrap_exception_for_gather(RuntimeError("boom"))
    assert wrapped[1][0]._code is None
    pickle.dumps(wrapped)


def test_wrap_exception_is_torchs_pair_of_the_exception_and_its_frames() -> None:
    with pytest.raises(RuntimeError) as info:
        _raise_runtime_error()
    exc, stack = filesystem_async._wrap_exception(info.value)
    assert exc is info.value and stack == torch_wrap_exception(info.value)[1]
    assert any(frame.name == "_raise_runtime_error" for frame in stack)


def test_finalize_of_a_failed_write_raises_its_error_and_commits_nothing(tmp_path) -> None:
    writer, _, metadata = prepared_writer(tmp_path, small_state())  # never written
    with pytest.raises(CheckpointException) as info:
        save_state_dict_async_finalize(writer, metadata, _DistWrapper(None, False, 0))
    assert [type(exc) for exc, _ in info.value.failures.values()] == [CheckpointWriteError]
    assert not (tmp_path / ".metadata").exists()


def test_finalize_raises_the_failure_an_nvrx_style_writer_returns(tmp_path) -> None:
    writer, _, metadata = prepared_writer(tmp_path, small_state())
    returned = filesystem_async._wrap_exception_for_gather(OSError(28, "No space left"))
    writer.retrieve_write_results = lambda: returned  # NVRx's writers return, not raise
    with pytest.raises(CheckpointException, match="No space left") as info:
        save_state_dict_async_finalize(writer, metadata, _DistWrapper(None, False, 0))
    assert isinstance(info.value, StorageError) and list(info.value.failures) == [0]
    assert not (tmp_path / ".metadata").exists()


def _raise_runtime_error() -> None:
    raise RuntimeError("disk on fire")


class _HoldsALock(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


def _raise_unpicklable() -> None:
    raise _HoldsALock("disk on fire")


def test_wrap_exception_for_gather_replaces_an_unpicklable_exception() -> None:
    with pytest.raises(_HoldsALock) as info:
        _raise_unpicklable()
    with pytest.raises(TypeError):
        pickle.dumps(info.value)
    exc, stack = pickle.loads(pickle.dumps(filesystem_async._wrap_exception_for_gather(info.value)))
    assert isinstance(exc, RemoteExceptionError)
    assert "_HoldsALock" in str(exc) and "disk on fire" in str(exc)
    assert "_raise_unpicklable" in exc.traceback_text
    assert any(frame.name == "_raise_unpicklable" for frame in stack)


# -- finalize_timeout (test_finalize_timeout.py) -----------------------------------------------


def _wait_then_return(gate: str, *_: Any, **__: Any) -> None:
    wait_for_file(gate)


def test_blocking_finalize_is_bounded_by_finalize_timeout(tmp_path) -> None:
    gate = str(tmp_path / "gate")
    caller = TemporalAsyncCaller(Timeouts(finalize=0.3))
    try:
        caller.schedule_async_call(AsyncRequest(_wait_then_return, (gate,), [], call_idx=0))
        started = time.monotonic()
        done = caller.is_current_async_call_done(blocking=True, no_dist=True, finalize_timeout=0.3)
        assert done is False
        assert 0.3 <= time.monotonic() - started < 30.0  # bounded, not hung
        # Without finalize_timeout a blocking wait past the deadline still raises.
        with pytest.raises(CheckpointTimeoutError, match="still running"):
            caller.is_current_async_call_done(blocking=True, no_dist=True)
    finally:
        caller.close(abort=True)


def test_blocking_finalize_returns_done_when_the_call_completes(tmp_path) -> None:
    gate = tmp_path / "gate"
    gate.touch()
    caller = TemporalAsyncCaller()
    try:
        caller.schedule_async_call(AsyncRequest(_wait_then_return, (str(gate),), [], call_idx=7))
        assert caller.is_current_async_call_done(blocking=True, no_dist=True, finalize_timeout=30)
        assert caller.is_current_async_call_done(blocking=True, no_dist=True)  # nothing left
    finally:
        caller.close(abort=True)


# -- source lifetime at the queue (test_staging_source_lifetime.py) -----------------------------


class _Payload:
    def __init__(self, value: int = 42) -> None:
        self.value = value


def _noop(*args: Any, **kwargs: Any) -> None:
    pass


def _preload_payload(payload: _Payload) -> int:
    return payload.value


class _HeldCaller(AsyncCaller):
    """Accepts requests without keeping them; reports done when told to."""

    def __init__(self) -> None:
        super().__init__()
        self.done = False
        self.indices: list[int] = []

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        assert async_req.finalize_fns == []
        self.indices.append(async_req.call_idx)

    def local_status(self, call_idx: int) -> LocalStatus:
        return LocalStatus(State.DONE if self.done else State.RUNNING)

    def wait_local(self, call_idx: int, timeout: float) -> LocalStatus:
        return self.local_status(call_idx)

    def close(self, abort: bool = False) -> list[int]:
        return []


@pytest.mark.parametrize("persistent", [True, False])
@pytest.mark.parametrize("field", ["async_fn", "async_fn_args", "async_fn_kwargs", "preload_fn"])
def test_queue_releases_what_the_write_reads_once_scheduled(monkeypatch, field, persistent) -> None:
    queue = AsyncCallsQueue(persistent=persistent)
    caller = _HeldCaller()
    monkeypatch.setattr(queue, "_get_async_caller", lambda: caller)
    finalized: list[int] = []
    try:
        for expected in range(2):
            payload = _Payload()
            payload_ref = weakref.ref(payload)
            execution = {
                "async_fn": functools.partial(_noop, payload),
                "async_fn_args": (0, payload),
                "async_fn_kwargs": {"source": payload},
                "preload_fn": functools.partial(_preload_payload, payload),
            }[field]
            # preload_fn's result replaces async_fn_args[1], so that case needs two args.
            request = AsyncRequest(
                _noop, (0, None), [functools.partial(finalized.append, expected)]
            )
            request = request._replace(**{field: execution})
            assert queue.schedule_async_request(request) == expected
            del request, execution, payload
            gc.collect()
            assert payload_ref() is None
            active = queue.async_calls[-1].async_request
            assert active.is_frozen and active.call_idx == expected
            assert active.async_fn is None and active.async_fn_args == ()
            assert active.async_fn_kwargs is None and active.preload_fn is None
        assert queue.maybe_finalize_async_calls(no_dist=True) == []
        assert finalized == []
        caller.done = True
        assert queue.maybe_finalize_async_calls(no_dist=True) == [0, 1]
        assert finalized == [0, 1] and caller.indices == [0, 1]
    finally:
        queue.close(abort=True)


def test_old_style_request_and_noop_keep_their_finalizers(monkeypatch) -> None:
    old_request = namedtuple("OldAsyncRequest", "async_fn async_fn_args finalize_fns")
    queue = AsyncCallsQueue()
    caller = _HeldCaller()
    monkeypatch.setattr(queue, "_get_async_caller", lambda: caller)
    finalized: list[str] = []
    try:
        queue.schedule_async_request(
            old_request(None, (), [functools.partial(finalized.append, "x")])
        )
        caller.done = True
        assert queue.maybe_finalize_async_calls(no_dist=True) == [0]
        assert finalized == ["x"]
    finally:
        queue.close(abort=True)


def test_a_failed_schedule_is_a_failed_call_and_the_next_one_runs(monkeypatch) -> None:
    """NVRx counts the call (its index is used) and raises; ours raises one of the package's
    errors, chained to the cause, and keeps the call as a failed one, so every rank's finalize
    agrees on it (a rank that caught the error stays in step)."""
    queue = AsyncCallsQueue()
    caller = _HeldCaller()
    monkeypatch.setattr(queue, "_get_async_caller", lambda: caller)

    def refuse(request: AsyncRequest) -> None:
        raise RuntimeError("schedule failed")

    try:
        monkeypatch.setattr(caller, "schedule_async_call", refuse)
        with pytest.raises(StagingError, match="rank 0: async request 0 .*schedule failed"):
            queue.schedule_async_request(AsyncRequest(_noop, (), []))
        assert queue.get_num_unfinalized_calls() == 1
        with pytest.raises(AsyncCallFailedError, match="async request 0 could not be staged"):
            queue.maybe_finalize_async_calls(no_dist=True)
        assert queue.get_num_unfinalized_calls() == 0
        monkeypatch.undo()
        monkeypatch.setattr(queue, "_get_async_caller", lambda: caller)
        assert queue.schedule_async_request(AsyncRequest(_noop, (), [])) == 1
    finally:
        queue.close(abort=True)


def _stage_payload(payload: _Payload) -> torch.Tensor:
    return torch.tensor(payload.value)


def test_fork_caller_keeps_staged_data_until_the_child_finishes(tmp_path) -> None:
    gate = str(tmp_path / "gate")
    queue = AsyncCallsQueue(persistent=False)
    source = _Payload()
    source_ref = weakref.ref(source)
    try:
        request = AsyncRequest(
            _wait_then_return,
            (gate, None),
            [],
            preload_fn=functools.partial(_stage_payload, source),
        )
        queue.schedule_async_request(request)
        caller = queue.async_calls[0].async_caller
        staged_ref = weakref.ref(caller.preloaded_holder)
        del request, source
        gc.collect()
        assert source_ref() is None and staged_ref() is not None
        assert queue.maybe_finalize_async_calls(no_dist=True) == []
        open(gate, "w").close()
        assert queue.maybe_finalize_async_calls(blocking=True, no_dist=True) == [0]
        gc.collect()
        assert staged_ref() is None
    finally:
        open(gate, "w").close()
        queue.close(abort=True)


@pytest.mark.parametrize("abort", [False, True])
@pytest.mark.parametrize("field", ["async_fn", "async_fn_args", "async_fn_kwargs"])
def test_fork_caller_without_preload_keeps_the_execution_alive(tmp_path, field, abort) -> None:
    gate = str(tmp_path / "gate")
    queue = AsyncCallsQueue(persistent=False)
    source = torch.tensor(42)
    source_ref = weakref.ref(source)
    request = {
        "async_fn": AsyncRequest(functools.partial(_wait_then_return, gate, source), (), []),
        "async_fn_args": AsyncRequest(_wait_then_return, (gate, source), []),
        "async_fn_kwargs": AsyncRequest(_wait_then_return, (gate,), [], {"source": source}),
    }[field]
    try:
        queue.schedule_async_request(request)
        del source, request
        gc.collect()
        assert source_ref() is not None  # the child may still read it
        assert queue.maybe_finalize_async_calls(no_dist=True) == []
        if abort:
            # Ours does not finalize a killed write as a success (NVRx returns [0] here).
            queue.async_calls[0].async_caller.close(abort=True)
            with pytest.raises(WorkerDiedError):
                queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
        else:
            open(gate, "w").close()
            assert queue.maybe_finalize_async_calls(blocking=True, no_dist=True) == [0]
        gc.collect()
        assert source_ref() is None
    finally:
        open(gate, "w").close()
        queue.close(abort=True)


# -- the writer hands its payload over (test_staging_source_lifetime.py) ------------------------


def _finish(writer: FileSystemWriterAsync, metadata: Any) -> None:
    _DistWrapper(None, False, 0).all_reduce(
        "write", writer.retrieve_write_results, functools.partial(writer.finish, metadata)
    )


@pytest.mark.parametrize("use_cpu_shm", [False, True])
def test_writer_transfers_its_payload_and_still_writes(tmp_path, use_cpu_shm) -> None:
    log = tmp_path / "opened.log"
    ckpt = tmp_path / "ckpt"
    writer, planner, metadata = prepared_writer(
        ckpt, small_state(), open_file=RecordingOpen(log), use_cpu_shm_for_gpu_tensors=use_cpu_shm
    )
    (_, _, (byte_data, tensor_data)) = writer.write_buckets[0]
    snapshot_ref = weakref.ref(tensor_data[0][1])
    byte_ref = weakref.ref(byte_data[0][1])
    del byte_data, tensor_data
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    assert writer.write_buckets is None and writer.has_data_to_write
    assert snapshot_ref() is not None
    with pytest.raises(RuntimeError, match="already been transferred"):
        writer.get_save_function_and_args()
    buckets = preload_fn()
    save_fn(args[0], buckets)
    del buckets, preload_fn, args, save_fn
    gc.collect()
    assert snapshot_ref() is None and byte_ref() is None
    _finish(writer, metadata)
    opened = log.read_text().splitlines()
    assert len(opened) == 1 and "__0_0.distcp" in opened[0] and opened[0].endswith(" wb")
    restored = {"value": torch.empty(8, dtype=torch.int64), "step": 0}
    dcp.load(restored, storage_reader=FileSystemReader(str(ckpt)), **no_dist_kwargs(dcp.load))
    assert torch.equal(restored["value"], torch.arange(8)) and restored["step"] == 3


def test_empty_writer_is_a_noop(tmp_path) -> None:
    assert FileSystemWriterAsync(tmp_path).get_save_function_and_args() == (None, None, [])


def test_open_file_failure_is_reported_as_a_worker_failure(tmp_path) -> None:
    writer, _, _ = prepared_writer(tmp_path / "ckpt", small_state(), open_file=failing_open)
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    save_fn(args[0], preload_fn())  # records the failure, does not raise
    with pytest.raises(CheckpointWriteError, match="Worker failure") as info:
        writer.retrieve_write_results()
    assert "worker critical failure during open()" in str(info.value)
    assert not (tmp_path / "ckpt" / "__0_0.distcp").exists()


def test_writer_refuses_bad_compat_keywords(tmp_path) -> None:
    with pytest.raises(ConfigurationError, match="open_file"):
        FileSystemWriterAsync(tmp_path, open_file="not callable")
    with pytest.raises(ConfigurationError, match="is_multiproc_io"):
        FileSystemWriterAsync(tmp_path, is_multiproc_io="yes")
    writer = FileSystemWriterAsync(
        tmp_path, use_cached_data_structure=True, use_cpu_shm_for_gpu_tensors=True
    )
    assert writer.use_cpu_shm_for_gpu_tensors and writer.use_cached_data_structure
    FileSystemWriterAsync._cached_identifiers.add("k")
    FileSystemWriterAsync.cleanup_tensor_caches()
    assert not FileSystemWriterAsync._cached_identifiers


# -- preload snapshots (test_preload_snapshot.py) -----------------------------------------------


def _buckets(tensor: torch.Tensor) -> list:
    return [("p", "__0_0.distcp", ([], [("item", tensor)]))]


def test_writer_preload_snapshots_shared_cpu_tensors() -> None:
    step = torch.tensor(1.0).share_memory_()
    ((_, _, (_, tensor_data)),) = FileSystemWriterAsync.preload_tensors(_buckets(step), False)
    preloaded = tensor_data[0][1]
    assert preloaded.untyped_storage().data_ptr() != step.untyped_storage().data_ptr()
    step.fill_(2.0)
    assert torch.equal(preloaded, torch.tensor(1.0))


def test_writer_preload_passes_private_cpu_tensors_by_reference() -> None:
    private = torch.arange(4, dtype=torch.float32)
    ((_, _, (_, tensor_data)),) = FileSystemWriterAsync.preload_tensors(_buckets(private), False)
    assert tensor_data[0][1].untyped_storage().data_ptr() == private.untyped_storage().data_ptr()


def test_utils_preload_clones_cpu_tensors_and_detaches() -> None:
    state = {
        "step": torch.tensor(3.0),
        "nested": [torch.ones(2)],
        "w": torch.ones(2, requires_grad=True),
    }
    preloaded = preload_tensors(state, non_blocking=False)
    assert preloaded["step"].data_ptr() != state["step"].data_ptr()
    assert preloaded["nested"][0].data_ptr() != state["nested"][0].data_ptr()
    state["step"].add_(1.0)
    state["nested"][0].add_(1.0)
    assert torch.equal(preloaded["step"], torch.tensor(3.0))
    assert torch.equal(preloaded["nested"][0], torch.ones(2))
    assert not preloaded["w"].requires_grad and torch.equal(preloaded["w"], torch.ones(2))


# -- metadata byte layout (test_metadata_reuse_offsets.py) ---------------------------------------


def _extra_state(amax: float, scale: float) -> torch.Tensor:
    """A uint8 tensor holding a torch.save blob, as Transformer Engine's _extra_state."""
    buf = io.BytesIO()
    torch.save({"scale": torch.full((1,), scale), "amax": torch.full((256,), amax)}, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _save_ours(state: dict, path: str) -> Any:
    dcp.save(state, storage_writer=FileSystemWriterAsync(path), **no_dist_kwargs(dcp.save))
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return pickle.load(f)


def test_our_layout_is_value_independent_and_only_bookkeeping_differs(tmp_path) -> None:
    a = _save_ours(
        {"w": torch.zeros(512), "b": torch.zeros(16), "x._extra_state": _extra_state(0.0, 1.0)},
        str(tmp_path / "a"),
    )
    b = _save_ours(
        {"w": torch.randn(512), "b": torch.randn(16), "x._extra_state": _extra_state(9.0, 5.0)},
        str(tmp_path / "b"),
    )
    assert a.storage_data == b.storage_data
    assert a.state_dict_metadata == b.state_dict_metadata
    assert a.storage_meta != b.storage_meta
    # Ours also records each data file's CRC32 (value-dependent by design); nothing else.
    differing = {k for k in vars(a) if getattr(a, k) != getattr(b, k)}
    assert differing == {"storage_meta", filesystem_async.FILE_TABLE_ATTR}
    # A non-tensor payload's length depends on its content: it shifts the layout.
    c = _save_ours({"blob": b"\x00" * 4096}, str(tmp_path / "c"))
    d = _save_ours({"blob": os.urandom(4096)}, str(tmp_path / "d"))
    assert c.storage_data != d.storage_data


# -- prepared-metadata layout guard (test_metadata_reuse_validation.py) ----------------------

_OPT, _WGT = "optimizer/shard_0_1", "decoder.weight/shard_0_1"
_OPT_LEN, _WGT_LEN, _OPT_LEN_GROWN = 1645, 4096, 1709


def _result(fqn: str, path: str, offset: int, length: int) -> WriteResult:
    return WriteResult(
        index=MetadataIndex(fqn=fqn),
        size_in_bytes=length,
        storage_data=_StorageInfo(relative_path=path, offset=offset, length=length),
    )


def _prepared(entries: list[tuple[str, str, int, int]]) -> Metadata:
    return Metadata(
        state_dict_metadata={},
        storage_data={
            MetadataIndex(fqn=f): _StorageInfo(relative_path=p, offset=o, length=n)
            for f, p, o, n in entries
        },
    )


_ONE_FILE = [(_OPT, "__0_0.distcp", 0, _OPT_LEN), (_WGT, "__0_0.distcp", _OPT_LEN, _WGT_LEN)]


def test_layout_guard_accepts_a_matching_layout() -> None:
    written = [_result(*entry) for entry in _ONE_FILE]
    assert _find_layout_mismatch(written, _prepared(_ONE_FILE)) is None


def test_layout_guard_reports_a_grown_non_tensor_item_first() -> None:
    written = [
        _result(_OPT, "__0_0.distcp", 0, _OPT_LEN_GROWN),
        _result(_WGT, "__0_0.distcp", _OPT_LEN_GROWN, _WGT_LEN),
    ]
    fqn, detail = _find_layout_mismatch(written, _prepared(_ONE_FILE))
    assert fqn == _OPT and str(_OPT_LEN) in detail and str(_OPT_LEN_GROWN) in detail


def test_layout_guard_reports_a_shifted_offset() -> None:
    written = [
        _result(_OPT, "__0_0.distcp", 0, _OPT_LEN),
        _result(_WGT, "__0_0.distcp", _OPT_LEN_GROWN, _WGT_LEN),
    ]
    assert _find_layout_mismatch(written, _prepared(_ONE_FILE))[0] == _WGT


def test_layout_guard_reports_an_item_missing_from_the_prepared_metadata() -> None:
    fqn, detail = _find_layout_mismatch(
        [_result("new.layer/shard_0_1", "__0_0.distcp", 0, 128)], _prepared(_ONE_FILE)
    )
    assert fqn == "new.layer/shard_0_1" and "absent" in detail


def test_layout_guard_reports_a_removed_last_item() -> None:
    fqn, detail = _find_layout_mismatch(
        [_result(_OPT, "__0_0.distcp", 0, _OPT_LEN)], _prepared(_ONE_FILE)
    )
    assert fqn == _WGT and "not written" in detail.lower()


def test_layout_guard_reports_an_item_moved_to_another_rank() -> None:
    prepared = _prepared(
        [(_OPT, "__0_0.distcp", 0, _OPT_LEN), ("moved/shard_0_1", "__0_0.distcp", _OPT_LEN, 256)]
    )
    written = [_result(_OPT, "__0_0.distcp", 0, _OPT_LEN)]
    assert _find_layout_mismatch(written, prepared)[0] == "moved/shard_0_1"


def test_layout_guard_leaves_other_ranks_files_to_them() -> None:
    prepared = _prepared(
        [(_OPT, "__0_0.distcp", 0, _OPT_LEN), ("peer/shard_0_1", "__1_0.distcp", 0, 512)]
    )
    assert _find_layout_mismatch([_result(_OPT, "__0_0.distcp", 0, _OPT_LEN)], prepared) is None


def test_reuse_and_create_exclude_each_other(tmp_path) -> None:
    with pytest.raises(ConfigurationError, match="exclude each other"):
        save_state_dict_async_finalize(
            FileSystemWriterAsync(tmp_path),
            None,
            _DistWrapper(None, False, 0),
            reuse_metadata_obj=_prepared(_ONE_FILE),
            create_metadata_path=str(tmp_path / "md"),
        )
