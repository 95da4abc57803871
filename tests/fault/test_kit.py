"""The fault kit's own pieces, one process each: what the matrix builds on does what it says."""

from __future__ import annotations

import errno
import os
import random
import types

import pytest
import torch

from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from resilient_ckpt.errors import ConfigurationError, WorkerDiedError
from resilient_ckpt.storage import get_backend
from resilient_ckpt.testing.faults import (
    Action,
    Fault,
    InjectedFault,
    Phase,
    flip_byte,
    inject,
    kill_during_save,
    truncate,
    wait_gone,
    worker_pids,
)
from tests import _helpers

pytestmark = pytest.mark.fault


def _write(path: str, data: bytes) -> None:
    with get_backend(path).open_write(path) as f:
        f.write(data)


def test_write_fault_leaves_the_bytes_before_its_offset_and_no_file(tmp_path) -> None:
    path = str(tmp_path / "f.bin")
    fault = Fault(Phase.WRITE, Action.RAISE, after_bytes=5, errno=errno.ENOSPC)
    with inject(fault), pytest.raises(InjectedFault) as caught:
        _write(path, b"0123456789")
    assert caught.value.errno == errno.ENOSPC
    assert not os.path.exists(path)  # the backend's atomic write never published it
    with inject(fault):
        _write(path, b"abc")  # shorter than the offset: the fault does not fire
    assert open(path, "rb").read() == b"abc"


def test_corrupt_flips_exactly_one_byte_and_ranks_filter(tmp_path) -> None:
    path = str(tmp_path / "f.bin")
    with inject(Fault(Phase.WRITE, Action.CORRUPT, after_bytes=3), rank=0):
        _write(path, b"\x00" * 8)
    assert open(path, "rb").read() == b"\x00\x00\x00\xff\x00\x00\x00\x00"
    with inject(Fault(Phase.OPEN_WRITE, Action.RAISE, ranks=[1]), rank=0):
        _write(path, b"ok")  # rank 0 is not a victim
    with inject(Fault(Phase.OPEN_WRITE, Action.RAISE, ranks=[1], match="*.x"), rank=1):
        _write(path, b"ok")  # the name does not match
        with pytest.raises(InjectedFault, match="rank 1"):
            _write(str(tmp_path / "g.x"), b"no")


def test_delay_and_bad_faults(tmp_path, monkeypatch) -> None:
    from resilient_ckpt.testing.faults import _plan

    slept: list[float] = []
    monkeypatch.setattr(_plan, "time", types.SimpleNamespace(sleep=slept.append))
    with inject(Fault(Phase.OPEN_READ, Action.DELAY, seconds=0.3)):
        _write(str(tmp_path / "a"), b"1")
        assert slept == []  # a write is not the phase
        with get_backend(str(tmp_path)).open_read(str(tmp_path / "a")) as f:
            assert f.read() == b"1"  # delayed, then carried on
    assert slept == [0.3]
    with pytest.raises(ConfigurationError):
        Fault(Phase.DURING_CALL, Action.RAISE)
    with pytest.raises(ConfigurationError):
        Fault(Phase.WRITE, Action.RAISE, times=0)


def test_flip_byte_and_truncate(tmp_path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(10)))
    offset = flip_byte(str(path), rng=random.Random(3))
    data = path.read_bytes()
    assert [k for k in range(10) if data[k] != k] == [offset]
    assert truncate(str(path), 4) == 6 and path.stat().st_size == 6
    with pytest.raises(ConfigurationError):
        flip_byte(str(path), offset=6)


@pytest.mark.timeout(120)
def test_kill_during_save_kills_the_worker_and_the_queue_reports_it(tmp_path) -> None:
    queue = AsyncCallsQueue(persistent=True)
    marker = str(tmp_path / "pid")
    state = {"w": torch.zeros(4)}
    request = AsyncRequest(
        _helpers.write_after_marker, (str(tmp_path / "x.pt"), state, marker, 30), []
    )
    queue.schedule_async_request(request)
    worker = int(_helpers.wait_for_file(marker, timeout=90))
    assert worker_pids(queue) == [worker]
    timer = kill_during_save(queue, target="worker", within=0.2, rng=random.Random(1))
    timer.join(5)
    assert timer.killed == worker
    assert wait_gone([worker], 10)[0] == []
    with pytest.raises(WorkerDiedError):
        queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    queue.close(abort=True)
    assert not os.path.exists(tmp_path / "x.pt")
