"""CUDA variants of NVRx's async tests (run only where a GPU is; the CPU versions of the
same behaviours are in the other test_compat_async_* files)."""

from __future__ import annotations

import functools
import gc
import weakref

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.utils import _DistWrapper

from resilient_ckpt._torch_compat import no_dist_kwargs
from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from resilient_ckpt.async_ckpt.torch_ckpt import TorchAsyncCheckpoint

from ._async_common import GatedOpen, prepared_writer, wait_for_file

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]

_NUMEL = 8 * 1024 * 1024  # 32 MiB of float32


def _finish(writer, metadata) -> None:
    _DistWrapper(None, False, 0).all_reduce(
        "write", writer.retrieve_write_results, functools.partial(writer.finish, metadata)
    )


def _schedule_cuda_save(queue, checkpoint_dir, started, release):
    """Every reference to the CUDA source is local here; only weak ones come back."""
    source = torch.full((_NUMEL,), 3.5, device="cuda", dtype=torch.float32)
    writer, _, metadata = prepared_writer(
        checkpoint_dir, {"value": source}, open_file=GatedOpen(started, release)
    )
    source_ref = weakref.ref(writer.write_buckets[0][2][1][0][1])
    allocated_with_source = torch.cuda.memory_allocated()
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    request = AsyncRequest(
        save_fn, args, [functools.partial(_finish, writer, metadata)], preload_fn=preload_fn
    )
    return source_ref, allocated_with_source, queue.schedule_async_request(request)


@pytest.mark.parametrize("is_daemon", [True, False])
def test_cuda_source_released_before_the_filesystem_write(tmp_path, is_daemon) -> None:
    """test_staging_source_lifetime_cuda.py::test_cuda_source_storage_released_before_filesystem_write"""
    queue = AsyncCallsQueue(is_daemon=is_daemon, cpu_priority=None)
    started, release = tmp_path / "write_started", tmp_path / "allow_write"
    checkpoint_dir = tmp_path / "checkpoint"
    finalized = False
    try:
        caller = queue._get_async_caller()
        caller._start_worker(0)  # warm, so its start-up is not measured
        caller.start()  # and wait for its handshake
        gc.collect()
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        source_ref, with_source, idx = _schedule_cuda_save(queue, checkpoint_dir, started, release)
        wait_for_file(started)
        gc.collect()
        torch.cuda.synchronize()
        assert not release.exists() and queue.get_num_unfinalized_calls() == 1
        assert source_ref() is None
        assert with_source - baseline >= _NUMEL * 4
        assert torch.cuda.memory_allocated() <= baseline + (4 << 20)
        release.touch()
        assert queue.maybe_finalize_async_calls(blocking=True, no_dist=True) == [idx]
        finalized = True
        restored = {"value": torch.empty(_NUMEL, dtype=torch.float32)}
        dcp.load(
            restored,
            storage_reader=FileSystemReader(str(checkpoint_dir)),
            **no_dist_kwargs(dcp.load),
        )
        assert torch.all(restored["value"] == 3.5)
    finally:
        release.touch()
        queue.close(abort=not finalized)


def test_cuda_async_save_equals_sync_save(tmp_path) -> None:
    """test_async_save.py::TestAsyncSave::test_async_is_equivalent_to_sync, on CUDA tensors"""
    state = {f"param_{i}": torch.rand(256, 256, device="cuda") for i in range(4)}
    ckpt = TorchAsyncCheckpoint()
    try:
        ckpt.async_save(state, tmp_path / "async.pt")
        ckpt.save(state, tmp_path / "sync.pt")
        ckpt.finalize_async_save(blocking=True)
        device = torch.device("cuda", torch.cuda.current_device())
        a = torch.load(tmp_path / "async.pt", map_location=device)
        b = torch.load(tmp_path / "sync.pt", map_location=device)
        for key, value in state.items():
            assert torch.equal(a[key], b[key]) and torch.equal(a[key], value)
    finally:
        ckpt.close()
