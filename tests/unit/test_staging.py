from __future__ import annotations

import functools

import pytest
import torch

from resilient_ckpt.async_ckpt import _copy
from resilient_ckpt.async_ckpt._arena import open_arena_fds
from resilient_ckpt.async_ckpt._protocol import Channel, Hello, ProtocolError, Result
from resilient_ckpt.async_ckpt._staging import ArenaPool, stage, unstage
from resilient_ckpt.errors import InvalidRequestError
from tests import _helpers


def _never() -> bool:
    return False


@pytest.mark.parametrize("copy", ["memmove", "copy_"])
def test_stage_snapshots_and_preserves_views_and_sharing(copy, monkeypatch) -> None:
    if copy == "copy_":  # every storage staged as a device storage is (see _copy)
        monkeypatch.setattr(_copy, "is_host", lambda storage: False)
    base = torch.arange(16, dtype=torch.float32)
    param = torch.nn.Parameter(torch.ones(3))
    obj = {
        "base": base,
        "view": base[4:8],
        "again": base,
        "param": param,
        "empty": torch.empty(0),
        "i": torch.tensor([1, 2], dtype=torch.int8),
        "t": torch.arange(6, dtype=torch.int64).reshape(2, 3).t(),  # its storage's bytes
        "c": torch.tensor([1 + 2j, 3 - 4j]).conj(),  # the conjugate bit: the raw bytes
        "fn": functools.partial(_helpers.write_tensors, "x"),
    }
    pool = ArenaPool(1)
    staged = stage(obj, pool, _never)
    base.add_(100)  # training goes on: the staged copy must not change
    param.data.add_(1)
    out = unstage(staged.payload, staged.arena, staged.slots)
    assert torch.equal(out["base"], torch.arange(16, dtype=torch.float32))
    assert torch.equal(out["view"], torch.arange(4, 8, dtype=torch.float32))
    assert out["view"].untyped_storage().data_ptr() == out["base"].untyped_storage().data_ptr()
    assert out["again"] is out["base"]
    assert isinstance(out["param"], torch.nn.Parameter) and out["param"].requires_grad
    assert torch.equal(out["param"].detach(), torch.ones(3))
    assert out["empty"].numel() == 0 and out["i"].dtype == torch.int8
    assert torch.equal(out["t"], torch.arange(6).reshape(2, 3).t()) and out["t"].stride() == (1, 3)
    assert torch.equal(out["c"].resolve_conj(), torch.tensor([1 - 2j, 3 + 4j]))
    # staged storage is only the bytes needed, not the whole arena
    assert out["base"].untyped_storage().nbytes() == 64
    pool.close()


def test_saves_of_one_structure_share_one_shared_memory_segment() -> None:
    before = open_arena_fds()
    pool = ArenaPool(2)
    state = {"w": torch.randn(1000)}
    for i in range(20):
        state["w"].fill_(i)
        staged = stage(state, pool, _never)
        assert torch.equal(unstage(staged.payload, staged.arena, staged.slots)["w"], state["w"])
        pool.release(staged.arena.arena_id)
        assert open_arena_fds() == before + 1, f"save {i}: a new memfd"
    pool.close()
    assert open_arena_fds() == before


def test_pool_bounded_when_all_busy() -> None:
    pool = ArenaPool(1)
    stage({"w": torch.ones(10)}, pool, _never)
    with pytest.raises(Exception, match="staging arenas stayed busy"):
        stage({"w": torch.ones(10)}, pool, _never)
    pool.close()


@pytest.mark.parametrize("cached", [False, True])
def test_a_failed_device_copy_is_a_staging_error_and_gives_the_arena_back(
    cached, monkeypatch
) -> None:
    """A ``copy_`` that fails (the copy_ path, on CPU, through the is_host seam) is reported
    as ours, and the arena goes back to the pool (nothing issued still writes into it)."""
    from resilient_ckpt.async_ckpt._structure import StageCache
    from resilient_ckpt.errors import StagingError

    monkeypatch.setattr(_copy, "is_host", lambda storage: False)
    pool, cache = ArenaPool(1), StageCache()
    state = {"w": torch.randn(64), "b": torch.randn(8)}
    if cached:  # a first save fills the cache; the second copies with its plan
        pool.release(stage(state, pool, _never, cache=cache).arena.arena_id)

    def broken(*args, **kwargs):
        return [(torch.empty(1), torch.empty(3))]  # sizes that cannot be copied

    monkeypatch.setattr(_copy, "device_pairs", broken)
    with pytest.raises(StagingError, match="device tensors"):
        stage(state, pool, _never, cache=cache if cached else None)
    assert not pool.busy and len(pool.free) == 1
    pool.close()


def test_unpicklable_argument_is_a_named_error() -> None:
    pool = ArenaPool(1)
    with pytest.raises(InvalidRequestError, match="cannot be sent to the background worker"):
        stage((lambda: None, (), None, None), pool, _never)
    pool.close()


def test_channel_rejects_mismatched_kind() -> None:
    import multiprocessing as mp

    a, b = mp.Pipe()
    left, right = Channel(a), Channel(b)
    left.send(Hello(pid=1))
    assert right.recv() == Hello(pid=1)
    a.send((Hello.KIND, Result(call_idx=1)))
    with pytest.raises(ProtocolError):
        right.recv()
    left.close()
    right.close()


def _wmem_max() -> int:
    try:
        with open("/proc/sys/net/core/wmem_max") as f:
            return int(f.read())
    except OSError:
        return 0


@pytest.mark.skipif(_wmem_max() < 1 << 20, reason="the kernel caps socket buffers below 1 MB")
def test_a_widened_channel_queues_a_large_payload_without_its_reader() -> None:
    import multiprocessing as mp
    import threading

    from resilient_ckpt.async_ckpt._protocol import Submit, widen_send_buffer

    a, b = mp.Pipe()
    widen_send_buffer(a)
    left, right = Channel(a), Channel(b)
    # About what a request of thousands of tensors pickles to.
    body = Submit(call_idx=1, arena_id=None, slots=(), payload=bytes(600_000))
    sender = threading.Thread(target=left.send, args=(body,), daemon=True)
    sender.start()
    sender.join(timeout=10)
    try:
        assert not sender.is_alive(), "the send waited for the reader"
        assert right.recv() == body
    finally:
        left.close()
        right.close()


def test_a_slot_table_travels_packed_and_arrives_as_the_plain_slots() -> None:
    import multiprocessing as mp
    import pickle

    from resilient_ckpt.async_ckpt._protocol import SlotTable, Submit

    slots = [(i * 4096, 100 + i) for i in range(300)] + [(1 << 40, (1 << 35) + 3)]
    table = SlotTable(slots)
    assert table == tuple(slots)
    once = pickle.dumps(table)
    assert len(once) < 16 * len(slots) + 200  # two int64 a slot, not 301 tuples
    assert pickle.dumps(table) == once  # packed once, then reused
    back = pickle.loads(once)
    assert type(back) is tuple and back == tuple(slots)
    assert pickle.loads(pickle.dumps(SlotTable(()))) == ()

    a, b = mp.Pipe()
    left, right = Channel(a), Channel(b)
    try:
        left.send(Submit(call_idx=3, arena_id=1, slots=table, payload=b"p"))
        got = right.recv()
        assert isinstance(got, Submit) and got.slots == tuple(slots) and got.payload == b"p"
    finally:
        left.close()
        right.close()


def test_staging_sends_its_slots_as_a_table() -> None:
    from resilient_ckpt.async_ckpt._protocol import SlotTable

    pool = ArenaPool(1)
    base = torch.arange(10.0)
    staged = stage(("fn", {"a": base, "v": base[2:5], "b": torch.ones(3)}), pool, lambda: False)
    try:
        assert isinstance(staged.slots, SlotTable) and len(staged.slots) == 2
    finally:
        pool.release(staged.arena.arena_id)
        pool.close()
