"""The worker writes a durable save's two tiers at the same time (``tiered._writes``): the
memory tier is not held back by the slower durable write, nor the durable write by it.
Each data file is opened through a hook that waits for the other tier's: written one tier
after the other, the first would wait forever (the barrier's deadline fails the test)."""

from __future__ import annotations

import dataclasses
import os
import threading
import warnings

import pytest
import torch

from resilient_ckpt.async_ckpt._dcp_write import take_report
from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from resilient_ckpt.async_ckpt.state_dict_saver import save_state_dict_async_plan
from resilient_ckpt.tiered._writes import write_tiers

pytestmark = pytest.mark.timeout(60)

_BOTH_OPEN = threading.Barrier(2, timeout=20)


def _open_when_both_tiers_write(path: str, mode: str):
    _BOTH_OPEN.wait()
    return open(path, mode)


def test_memory_and_durable_tiers_are_written_concurrently(tmp_path) -> None:
    state = {"w": torch.arange(4096.0), "b": torch.ones(17), "step": 3}
    memory_dir, durable_dir = tmp_path / "memory", tmp_path / "durable"
    writer = FileSystemWriterAsync(str(memory_dir), thread_count=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_state_dict_async_plan(state, writer)
    _, preload_fn, args = writer.get_save_function_and_args()
    buckets = preload_fn()
    memory_job = dataclasses.replace(writer._job, open_file=_open_when_both_tiers_write)
    os.makedirs(durable_dir)
    durable_job = dataclasses.replace(
        memory_job, checkpoint_dir=str(durable_dir), token="durable-token"
    )
    write_tiers(memory_job, durable_job, 0, buckets)
    for directory, job in ((memory_dir, memory_job), (durable_dir, durable_job)):
        report = take_report(job)
        assert report.failure is None, report.failure
        names = [f.name for f in report.files]
        assert names == [name for _, name, _ in buckets]
        for record in report.files:
            assert os.path.getsize(directory / record.name) == record.size
    first = buckets[0][1]
    assert (memory_dir / first).read_bytes() == (durable_dir / first).read_bytes()
