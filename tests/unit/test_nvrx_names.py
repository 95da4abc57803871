"""The names kept only for NVRx's callers (``async_ckpt/_nvrx.py``), as those callers use them."""

from __future__ import annotations

import multiprocessing

import pytest

from resilient_ckpt.async_ckpt import filesystem_async


@pytest.fixture
def fresh_results_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(filesystem_async, "_results_queue", None)


@pytest.mark.usefixtures("fresh_results_queue")
def test_results_queue_is_made_once_as_megatron_warms_up_and_starts_no_process() -> None:
    children = set(multiprocessing.active_children())
    # megatron/training/async_utils.py: init_persistent_async_worker, then reset.
    queue = filesystem_async.get_write_results_queue(mp_mode="fork")
    assert filesystem_async._results_queue is queue
    assert filesystem_async.get_write_results_queue() is queue
    assert set(multiprocessing.active_children()) == children  # no manager process
    queue.put("result")
    assert queue.get(timeout=1) == "result"
    filesystem_async._results_queue._manager.shutdown()


@pytest.mark.usefixtures("fresh_results_queue")
def test_results_queue_refuses_an_unknown_start_method() -> None:
    with pytest.raises(ValueError):
        filesystem_async.get_write_results_queue(mp_mode="no-such-method")
    assert filesystem_async._results_queue is None


def test_metadata_cache_is_initialised_without_loaded_metadata(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from resilient_ckpt.async_ckpt import state_dict_saver

    monkeypatch.setattr(state_dict_saver, "_checkpoint_metadata_cache", None)
    assert state_dict_saver.get_metadata_caching_status() is None
    state_dict_saver.init_checkpoint_metadata_cache()  # as NVRx's async_writer example calls it
    assert state_dict_saver.get_metadata_caching_status() == (False, False)
