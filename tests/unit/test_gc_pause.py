"""The collector pause around the DCP finalize (``state_dict_saver.collector_paused``)."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed.checkpoint as dcp

from resilient_ckpt.async_ckpt.core import AsyncCallsQueue
from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from resilient_ckpt.async_ckpt.state_dict_saver import collector_paused
from tests.fault._common import dcp_request

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_the_pause_restores_the_collector_as_it_found_it(collector_on) -> None:
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():  # nested: the outer pause re-enables
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(KeyError), collector_paused():
        raise KeyError("x")
    assert gc.isenabled()
    gc.disable()  # a collector the user turned off stays off
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_dcp_finalize_gathers_and_commits_with_the_collector_paused(
    tmp_path, monkeypatch, collector_on
) -> None:
    seen: list[tuple[str, bool]] = []
    for name in ("retrieve_write_rows", "finish"):
        real = getattr(FileSystemWriterAsync, name)

        def spy(self, *args, _real=real, _name=name, **kwargs):
            seen.append((_name, gc.isenabled()))
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(FileSystemWriterAsync, name, spy)
    state = {f"w{i}": torch.full((4,), float(i)) for i in range(50)}
    queue = AsyncCallsQueue()
    try:
        queue.schedule_async_request(dcp_request(state, str(tmp_path / "ckpt")))
        queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    finally:
        queue.close()
    assert seen == [("retrieve_write_rows", False), ("finish", False)]
    assert gc.isenabled()
    loaded = {k: torch.zeros(4) for k in state}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "ckpt"))
    assert all(torch.equal(loaded[k], state[k]) for k in state)
