"""The steady state (issue 13): a job saves the same state again and again, changing values,
and now and then its structure, types or sharing. Each checkpoint must hold exactly the values
of its call, whatever changed since the last save, in every flow (staging, torch.save, DCP,
local); and the structure walk and key must tell every change that matters apart. That the
unchanged saves take the fast paths is the performance contract
(``test_performance_contract.py``), which walks these same change tables."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from resilient_ckpt.async_ckpt import _copy, _staging
from resilient_ckpt.async_ckpt._staging import ArenaPool, stage, unstage
from resilient_ckpt.async_ckpt._structure import StageCache
from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from resilient_ckpt.async_ckpt.state_dict_saver import (
    CheckpointMetadataCache,
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from resilient_ckpt.async_ckpt.torch_ckpt import TorchAsyncCheckpoint
from tests import _helpers

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _never() -> bool:
    return False


def _state() -> dict:
    torch.manual_seed(0)
    base = torch.arange(32, dtype=torch.float32)
    state: dict = {f"w{i}": torch.randn(10 + i) for i in range(12)}
    state["base"] = base
    state["view"] = base[4:12]
    state["param"] = torch.nn.Parameter(torch.ones(3))
    state["z"] = torch.tensor([1 + 2j, -3j])
    state["step"] = 1
    return state


def _expected(state: dict) -> dict:
    return {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in state.items()}


def _same(expected: dict, got: dict, what: str = "") -> None:
    assert expected.keys() == got.keys(), what
    for key, value in expected.items():
        if torch.is_tensor(value):
            assert got[key].dtype == value.dtype and got[key].shape == value.shape, (what, key)
            assert torch.equal(got[key].detach(), value), (what, key)
        else:
            assert got[key] == value, (what, key)


def _shift_tensors(state: dict, delta: float) -> None:
    """Change every top-level tensor of ``state`` in place (after a save's call: the
    checkpoint must not see it)."""
    for value in state.values():
        if torch.is_tensor(value):
            value.data.add_(delta)


def _replace_same_shape(s: dict) -> None:
    s["w1"] = torch.full_like(s["w1"], 5.0)  # a new object, other memory


def _set_storage(s: dict) -> None:
    s["w2"].set_(torch.full((12,), 3.0))  # same object, swapped storage


def _retype_in_place(s: dict) -> None:
    s["w3"].data = s["w3"].data.view(torch.int32)  # same memory and shape, other dtype


def _restride(s: dict) -> None:
    s["w4"] = s["w4"].as_strided((7,), (2,))  # same storage, other layout


CHANGES = [
    ("values only", lambda s: s["w0"].add_(1), True),
    ("non-tensor value", lambda s: s.__setitem__("step", 2), True),
    ("tensor replaced by a new object of the same shape", _replace_same_shape, False),
    ("storage swapped in place", _set_storage, False),
    ("dtype changed over the same memory", _retype_in_place, False),
    ("stride changed over the same storage", _restride, False),
    ("requires_grad turned off", lambda s: s["param"].requires_grad_(False), False),
    ("parameter replaced by its data", lambda s: s.__setitem__("param", s["param"].data), False),
    ("view moved inside its base", lambda s: s.__setitem__("view", s["base"][5:13]), False),
    ("tensor added", lambda s: s.__setitem__("extra", torch.ones(4)), False),
    ("tensor removed", lambda s: s.pop("w5"), False),
    ("view replaced by its base (tied)", lambda s: s.__setitem__("view", s["base"]), False),
    ("conjugate bit set over the same bytes", lambda s: s.__setitem__("z", s["z"].conj()), False),
    ("conjugate bit cleared", lambda s: s.__setitem__("z", s["z"].conj()), False),
    ("values only after changes", lambda s: s["w0"].add_(1), True),
]


@pytest.mark.parametrize("copy", ["memmove", "copy_"])
def test_each_staging_holds_its_calls_values_whatever_changed(copy, monkeypatch) -> None:
    if copy == "copy_":  # every storage staged as a device storage is (see _copy)
        monkeypatch.setattr(_copy, "is_host", lambda storage: False)
    pool = ArenaPool(1)
    cache = StageCache()
    state = _state()
    staged = stage(("fn", state), pool, _never, cache=cache)
    pool.release(staged.arena.arena_id)
    for what, change, _reusable in CHANGES:
        change(state)
        expected = _expected(state)
        staged = stage(("fn", state), pool, _never, cache=cache)
        for value in state.values():  # the caller's tensors change right after the call
            if torch.is_tensor(value):
                value.data.fill_(-7)
        _, got = unstage(staged.payload, staged.arena, staged.slots)
        _same(expected, got, what)
        assert got["view"].untyped_storage().data_ptr() == got["base"].untyped_storage().data_ptr()
        for key, value in got.items():  # no aliasing with the caller's memory
            if torch.is_tensor(value):
                assert value.untyped_storage().data_ptr() != state[key].untyped_storage().data_ptr()
        del got
        pool.release(staged.arena.arena_id)
        for key, value in expected.items():
            if torch.is_tensor(value):
                state[key].data.copy_(value)
    pool.close()


def test_device_copies_hold_each_saves_values_and_fill_each_slot_as_planned(monkeypatch) -> None:
    monkeypatch.setattr(_copy, "is_host", lambda storage: False)
    base = torch.arange(8.0)
    state = {
        "w": torch.randn(4, 5),  # its storage's bytes in order: copied as itself
        "v": base[2:6],  # a view first: its storage is copied whole, as raw bytes ...
        "b": base,  # ... unless its base comes along: then as the base
        "t": torch.randn(5, 4).t(),  # transposed: raw bytes
        "h": torch.randn(6, dtype=torch.float16)[1:],  # a view alone: raw bytes
    }
    pool, cache = ArenaPool(1), StageCache()
    for _ in range(4):
        expected = _expected(state)
        staged = stage(("fn", state), pool, _never, cache=cache)
        _shift_tensors(state, 1.0)
        _, got = unstage(staged.payload, staged.arena, staged.slots)
        _same(expected, got)
        assert got["v"].untyped_storage().data_ptr() == got["b"].untyped_storage().data_ptr()
        del got
        pool.release(staged.arena.arena_id)
    pool.close()

    staging = _staging._Plan.of(state, _staging._Explicit.of([]), "state")
    plan = _copy.plan_device_copies(
        staging.tensors,
        staging.slots.slot_of,
        [(0, s.nbytes) for s in staging.slots.pending],
        [s.host for s in staging.slots.pending],
    )
    # In slot order (w, view/base, t, h): who fills each slot, and how.
    filled = [(staging.tensors[e.source], e.whole) for e in plan.slots]
    assert [(t is state[k], whole) for (t, whole), k in zip(filled, "wbth", strict=True)] == [
        (True, True),
        (True, True),
        (True, False),
        (True, False),
    ]


def test_tensors_pickled_by_value_are_staged_with_each_saves_values() -> None:
    pool = ArenaPool(1)
    cache = StageCache()
    sparse = torch.eye(3).to_sparse()
    for i in range(3):
        state = {"dense": torch.ones(4) * i, "sparse": sparse * i}
        staged = stage(state, pool, _never, cache=cache)
        got = unstage(staged.payload, staged.arena, staged.slots)
        assert torch.equal(got["sparse"].to_dense(), torch.eye(3) * i)
        assert torch.equal(got["dense"], torch.ones(4) * i)
        pool.release(staged.arena.arena_id)
    # Unstaging validates its sparse tensors as torch.load does: none is left on torch's
    # pending list, where a later torch.load would validate it over the released arena.
    assert not torch._utils._sparse_tensors_to_validate
    pool.close()


def _lists(split: int, tensors: list) -> tuple:
    return ("fn", tensors[:split], tensors[split:], tensors[0])


def test_lists_of_tensors_stage_alike_however_they_are_split() -> None:
    pool = ArenaPool(1)
    cache = StageCache()
    base = torch.arange(12, dtype=torch.float32)
    param = torch.nn.Parameter(torch.ones(3))
    tensors = [base, base[2:6], param, torch.full((2, 2), 5.0), torch.empty(0)]
    sizes = []
    # Saves 2 and 4 meet the layout of the save before; 3 splits the same tensors otherwise.
    for n, split in enumerate((2, 2, 3, 3)):
        expected = [t.detach().clone() for t in tensors]
        staged = stage(_lists(split, tensors), pool, _never, cache=cache)
        sizes.append(len(staged.payload))
        for t in tensors:
            t.data.add_(100)  # training goes on after the call
        _, first, second, single = unstage(staged.payload, staged.arena, staged.slots)
        got = [*first, *second]
        assert type(first) is list and [len(first), len(second)] == [split, 5 - split]
        for want, have, source in zip(expected, got, tensors, strict=True):
            assert torch.equal(want, have.detach()) and have.stride() == source.stride(), n
            assert type(have) is type(source) and have.requires_grad == source.requires_grad
        # A view shares its base's slot; the tensor met again is the same object.
        assert got[0].untyped_storage().data_ptr() == got[1].untyped_storage().data_ptr()
        assert single is got[0]
        assert got[0].untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
        del first, second, single, got
        pool.release(staged.arena.arena_id)
        for t in tensors:
            t.data.sub_(100)
    assert sizes[0] == sizes[1]
    pool.close()


def test_a_list_with_a_tensor_by_value_is_staged() -> None:
    pool = ArenaPool(1)
    cache = StageCache()
    for i in range(2):
        tensors = [torch.ones(4) * i, torch.eye(3).to_sparse() * i]
        staged = stage(tensors, pool, _never, cache=cache)
        dense, sparse = unstage(staged.payload, staged.arena, staged.slots)
        assert torch.equal(dense, torch.ones(4) * i)
        assert torch.equal(sparse.to_dense(), torch.eye(3) * i)
        pool.release(staged.arena.arena_id)
    pool.close()


@pytest.mark.timeout(120)
def test_torch_flow_saves_every_change(tmp_path) -> None:
    ckpt = TorchAsyncCheckpoint(copy_threads=2)
    try:
        state = _state()
        ckpt.async_save(state, str(tmp_path / "first.pt"))
        ckpt.finalize_async_save(blocking=True)
        for n, (what, change, _reusable) in enumerate(CHANGES):
            change(state)
            expected = _expected(state)
            ckpt.async_save(state, str(tmp_path / f"{n}.pt"), overlap_staging=n % 2 == 1)
            ckpt.wait_for_snapshot()
            _shift_tensors(state, 100)
            ckpt.finalize_async_save(blocking=True)
            _shift_tensors(state, -100)
            _same(expected, torch.load(tmp_path / f"{n}.pt"), what)
    finally:
        ckpt.close()


def _dcp_save(queue: AsyncCallsQueue, state: dict, path, cache) -> None:
    writer = FileSystemWriterAsync(str(path), thread_count=2)
    plan_ret = save_state_dict_async_plan(state, writer, enable_cache=True, metadata_cache=cache)
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    finalize = [lambda: save_state_dict_async_finalize(*plan_ret)]
    queue.schedule_async_request(AsyncRequest(save_fn, args, finalize, preload_fn=preload_fn))


DCP_CHANGES = [
    ("values only", lambda s: s["w0"].add_(1), True),
    ("non-tensor value", lambda s: s.__setitem__("step", 7), True),
    ("nested non-tensor value", lambda s: s["opt"].__setitem__("lr", 0.5), True),
    ("list of numbers changed", lambda s: s["opt"].__setitem__("betas", [0.8, 0.9]), True),
    ("tensor replaced by a new object of the same shape", _replace_same_shape, True),
    ("storage swapped in place", _set_storage, True),
    ("shape changed", lambda s: s.__setitem__("w6", torch.randn(3, 3)), False),
    ("dtype changed", lambda s: s.__setitem__("w7", s["w7"].double()), False),
    ("requires_grad changed", lambda s: s["param"].requires_grad_(False), False),
    ("nested tensor added", lambda s: s["opt"].__setitem__("m", torch.ones(2)), False),
    ("list now holds a tensor", lambda s: s["opt"].__setitem__("betas", [torch.ones(1)]), False),
    # A list holding tensors or mappings is flattened element by element, and modelled so.
    ("still a list with a tensor", lambda s: s["w0"].add_(1), True),
    ("list back to numbers", lambda s: s["opt"].__setitem__("betas", [0.1, 0.2]), False),
    ("param groups added", lambda s: s["opt"].__setitem__("groups", _groups(1)), False),
    ("a param group's value", lambda s: s["opt"]["groups"][0].__setitem__("lr", 0.01), True),
    ("a param group's tuple", lambda s: s["opt"]["groups"][0].__setitem__("b", (0.8, 0.9)), True),
    ("a param group added", lambda s: s["opt"].__setitem__("groups", _groups(2)), False),
    (
        "a tensor in a param group",
        lambda s: s["opt"]["groups"][1].__setitem__("t", torch.ones(3)),
        False,
    ),
    ("still that tensor", lambda s: s["opt"]["groups"][1]["t"].add_(1), True),
    ("key removed", lambda s: s.pop("w8"), False),
    ("values only after changes", lambda s: s["w0"].add_(1), True),
]


def _groups(n: int) -> list[dict]:
    """Param groups as an optimizer's (or get_state_dict's) state has them."""
    return [{"lr": 0.1, "b": (0.9, 0.99), "params": [f"w{i}"], "fused": None} for i in range(n)]


def _dcp_state() -> dict:
    state = {k: v for k, v in _state().items() if k != "view"}
    state["opt"] = {"lr": 0.1, "betas": [0.9, 0.99], "m": {"a": torch.zeros(5)}}
    return state


def _load_target(state: dict) -> dict:
    def empty(value):
        if torch.is_tensor(value):
            return torch.zeros_like(value.detach())
        if isinstance(value, dict):
            return {k: empty(v) for k, v in value.items()}
        if isinstance(value, list):
            return [empty(v) for v in value]
        return None

    return {k: empty(v) for k, v in state.items()}


def _same_nested(expected, got, what: str = "") -> None:
    if isinstance(expected, dict):
        assert expected.keys() == got.keys(), what
        for key in expected:
            _same_nested(expected[key], got[key], what)
    elif isinstance(expected, list):
        assert len(expected) == len(got), what
        for a, b in zip(expected, got, strict=True):
            _same_nested(a, b, what)
    elif torch.is_tensor(expected):
        assert got.dtype == expected.dtype, what
        assert torch.equal(got.detach(), expected.detach()), what
    else:
        assert got == expected, what


def _clone_nested(value):
    if torch.is_tensor(value):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone_nested(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone_nested(v) for v in value]
    return value


@pytest.mark.timeout(180)
def test_dcp_flow_saves_every_change(tmp_path) -> None:
    """Saved again after each change of ``DCP_CHANGES`` (values, nested values, shapes,
    dtypes, containers), every DCP checkpoint loads to exactly its call's state."""
    warnings.filterwarnings("ignore")
    cache = CheckpointMetadataCache()
    queue = AsyncCallsQueue()
    state = _dcp_state()
    try:
        _dcp_save(queue, state, tmp_path / "first", cache)
        queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
        for n, (what, change, _steady) in enumerate(DCP_CHANGES):
            change(state)
            expected = _clone_nested(state)
            _dcp_save(queue, state, tmp_path / f"d{n}", cache)
            _shift_tensors(state, 50)
            queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
            _shift_tensors(state, -50)
            target = _load_target(state)
            dcp.load(target, checkpoint_id=str(tmp_path / f"d{n}"))
            # Non-tensor leaves come back through the byte items; lists become leaves.
            _same_nested(expected, target, what)
    finally:
        queue.close()


def _share_config(s: dict) -> None:
    s["config_again"] = s["config"]  # one dict, twice


def _unshare_config(s: dict) -> None:
    s["config_again"] = dict(s["config"])


# (what changes, the change), applied one after the other, each followed by a save
LOCAL_CHANGES = [
    ("values only", lambda s: s["w0"].add_(1)),
    ("non-tensor value", lambda s: s.__setitem__("step", 2)),
    ("values only again", lambda s: s["w0"].add_(1)),
    ("float value to its negative zero", lambda s: s.__setitem__("lr", -0.0)),
    ("tensor replaced by a new object of the same shape", _replace_same_shape),
    ("nested list value", lambda s: s["nested"]["l"].__setitem__(1, 9)),
    ("a value and a tensor's shape", lambda s: s.update(step=3, w6=torch.randn(3, 3))),
    ("dtype changed", lambda s: s.__setitem__("w7", s["w7"].double())),
    ("tensor added in a tuple", lambda s: s["nested"].__setitem__("t", (torch.ones(2),))),
    ("an object of another type", lambda s: s.__setitem__("obj", {3, 4})),
    ("still that object", lambda s: s["w0"].add_(1)),
    ("values only after changes", lambda s: s.pop("obj") and s["w0"].add_(1)),
    ("a value beside a tuple's tensor", lambda s: s.__setitem__("step", 4)),
    ("requires_grad turned off", lambda s: s["param"].requires_grad_(False)),
    ("only a stride changed", lambda s: s.__setitem__("w8", torch.randn(36)[::2])),
    ("the same tensor twice", lambda s: s.__setitem__("again", s["w0"])),
    ("a value, the same tensor twice", lambda s: s.__setitem__("step", 5)),
    ("an int became a float", lambda s: s.__setitem__("step", 5.0)),
    ("a config dict now held twice", _share_config),
    ("the shared config changed through one reference", lambda s: s["config"].update(n=2)),
    ("the config held as two dicts again", _unshare_config),
    ("module state_dict attributes", lambda s: s["model"]._metadata[""].update(version=2)),
    ("a part of tensors gains a plain value", lambda s: s["opt"][0].update(note="warm")),
]


@pytest.mark.timeout(120)
def test_local_flow_saves_every_change(tmp_path) -> None:
    """Saved again after each change of ``LOCAL_CHANGES`` (of values, structure, types or
    sharing), a local checkpoint holds exactly the state of its call."""
    from resilient_ckpt.local import BasicTensorAwareStateDict, LocalCheckpointManager
    from resilient_ckpt.utils import diff

    state = {k: v for k, v in _state().items() if k != "view"}
    state["lr"] = 0.0
    state["nested"] = {"l": [1, 2], "t": (3, "x")}
    state["config"] = {"name": "run"}
    state["config_again"] = {"name": "run"}
    state["model"] = torch.nn.Linear(3, 2).state_dict()  # an OrderedDict with _metadata
    state["opt"] = {0: {"m": torch.rand(3), "v": torch.rand(3)}}
    manager = LocalCheckpointManager(str(tmp_path), "s", keep_latest=1)
    queue = AsyncCallsQueue()
    try:
        manager.save(BasicTensorAwareStateDict(state), 1, is_async=False)
        for n, (what, change) in enumerate(LOCAL_CHANGES, start=2):
            change(state)
            expected = _clone_nested(state)
            expected["nested"]["t"] = tuple(_clone_nested(list(state["nested"]["t"])))
            request = manager.save(BasicTensorAwareStateDict(state), n, is_async=True)
            queue.schedule_async_request(request)
            _shift_tensors(state, 100)
            queue.maybe_finalize_async_calls(blocking=True)
            _shift_tensors(state, -100)
            loaded = LocalCheckpointManager(str(tmp_path), "s")
            assert loaded.find_latest() == n
            got = loaded.load()[0].state_dict
            assert diff(expected, got) == ([], [], []), what
            assert _helpers.skeleton(got) == _helpers.skeleton(state), what
            shared = state["config_again"] is state["config"]
            assert (got["config_again"] is got["config"]) == shared, what
            assert got["model"]._metadata == state["model"]._metadata, what
    finally:
        queue.close()


# (what changes, the change to the custom state's tensors), one after the other
CUSTOM_CHANGES = [
    ("values only", lambda ts: ts[0].add_(1)),
    ("values of new objects", lambda ts: ts.__setitem__(1, ts[1] + 1)),
    *_helpers.LIST_STATE_CHANGES,
]


def test_local_flow_saves_every_change_of_a_custom_state(tmp_path) -> None:
    """A custom ``TensorAwareStateDict`` (planned by its own ``pop_tensors``), saved after
    each change of ``CUSTOM_CHANGES``, loads with exactly the tensors of that save: values,
    dtypes, shapes, ``requires_grad`` and parameter or not."""
    from resilient_ckpt.errors import ConfigurationError
    from resilient_ckpt.local import LocalCheckpointManager

    tensors = [torch.rand(4) for _ in range(6)]
    manager = LocalCheckpointManager(str(tmp_path), "s")
    manager.save(_helpers.ListState(tensors, 1), 1)
    for n, (what, change) in enumerate(CUSTOM_CHANGES, start=2):
        change(tensors)
        manager.save(_helpers.ListState(tensors, n), n)
        loader = LocalCheckpointManager(str(tmp_path), "s")
        assert loader.find_latest() == n
        got = loader.load()[0]
        assert isinstance(got, _helpers.ListState) and got.iteration == n, what
        assert len(got.tensors) == len(tensors), what
        for saved, loaded in zip(tensors, got.tensors, strict=True):
            assert loaded.dtype == saved.dtype and torch.equal(loaded, saved), what
            assert loaded.requires_grad == saved.requires_grad, what
            param = isinstance(saved, torch.nn.Parameter)
            assert type(loaded) is (torch.nn.Parameter if param else torch.Tensor), what
    tensors[1] = torch.eye(3).to_sparse()
    with pytest.raises(ConfigurationError, match="tensor #1"):
        manager.save(_helpers.ListState(tensors, len(CUSTOM_CHANGES) + 2), len(CUSTOM_CHANGES) + 2)


@pytest.mark.timeout(120)
def test_a_save_after_a_warmup_holds_its_calls_values(tmp_path) -> None:
    """Warmed up with the state it saves or with another, the first save is exact."""
    for warm_state in ("same", "other"):
        ckpt = TorchAsyncCheckpoint()
        try:
            state = _state()
            ckpt.warmup(state if warm_state == "same" else {"x": torch.ones(3)})
            state["w0"].add_(1)  # values change after the warm-up
            expected = _expected(state)
            ckpt.async_save(state, str(tmp_path / f"{warm_state}.pt"))
            _shift_tensors(state, 100)
            ckpt.finalize_async_save(blocking=True)
            _same(expected, torch.load(tmp_path / f"{warm_state}.pt"))
        finally:
            ckpt.close()


@pytest.mark.timeout(120)
def test_saves_of_device_copies_after_a_warmup_hold_their_calls_values(
    tmp_path, monkeypatch
) -> None:
    """With device copies (every storage staged as one here, see _copy), the warm-up builds
    the arena's typed views that the saves after it copy into: each checkpoint holds its
    call's values."""
    monkeypatch.setattr(_copy, "is_host", lambda storage: False)
    ckpt = TorchAsyncCheckpoint()
    try:
        state = _state()
        ckpt.warmup(state)
        for n in range(3):
            expected = _expected(state)
            ckpt.async_save(state, str(tmp_path / f"{n}.pt"))
            _shift_tensors(state, 1.0)
            ckpt.finalize_async_save(blocking=True)
            _same(expected, torch.load(tmp_path / f"{n}.pt"))
    finally:
        ckpt.close()


def test_local_warmup_needs_a_tensor_aware_state_dict(tmp_path) -> None:
    from resilient_ckpt.errors import ConfigurationError
    from resilient_ckpt.local import LocalCheckpointManager

    manager = LocalCheckpointManager(str(tmp_path), "s")
    with pytest.raises(ConfigurationError, match="BasicTensorAwareStateDict"):
        manager.warmup({"w": torch.ones(2)})  # type: ignore[arg-type]


def _walk_states() -> list[dict]:
    return [
        {"model": {f"l{i}": torch.rand(4) for i in range(20)}, "step": 3, "lr": 0.1},
        {"a": torch.rand(2), "b": torch.nn.Parameter(torch.rand(2)), "c": 1, "d": None},
        {"a": torch.rand(2, requires_grad=True), "b": "x", "c": torch.rand(3).double()},
        {"opt": {"state": {0: {"m": torch.rand(3), "step": 1}}, "groups": [{"lr": 1}]}},
        {"a": 1, "b": 2.0, "c": b"raw", "e": [1, 2]},
        {},
    ]


def test_walk_of_uniform_mappings_equals_the_entry_by_entry_walk(monkeypatch) -> None:
    """The C-level walk of mappings of one tensor type gives exactly the leaves, tensors and
    tensor descriptions of the entry-by-entry walk; a changed requires_grad changes the key."""
    from resilient_ckpt.async_ckpt import _structure

    states = _walk_states()
    fast = [_structure.walk(state) for state in states]
    with monkeypatch.context() as patch:
        patch.setattr(_structure, "_UNIFORM", frozenset())
        slow = [_structure.walk(state) for state in states]
    for got, want in zip(fast, slow, strict=True):
        assert got is not None and want is not None
        assert got.key[1:] == want.key[1:] and got.values == want.values
        assert got.plain == want.plain
        for ours, theirs in ((got.leaves, want.leaves), (got.tensors, want.tensors)):
            assert len(ours) == len(theirs)
            assert all(a is b for a, b in zip(ours, theirs, strict=True))
    cache: _structure.StructureCache[str] = _structure.StructureCache()
    before = _structure.walk(states[0])
    assert before is not None
    cache.remember(before.key, before.tensors, "plan")  # the tensors' check is taken here
    states[0]["model"]["l3"].requires_grad_(True)
    after = _structure.walk(states[0])
    assert after is not None and cache.lookup(after.key, after.tensors) is None


def _same_structure(first: Any, second: Any) -> bool:
    """Whether a structure cache filled for the walk ``first`` answers the walk ``second``."""
    from resilient_ckpt.async_ckpt._structure import StructureCache

    cache: StructureCache[str] = StructureCache()
    cache.remember(first.key, first.tensors, "plan")
    return second is not None and cache.lookup(second.key, second.tensors) == "plan"


def test_walk_leaves_are_dcp_flat_values_in_order() -> None:
    """The walk's leaves are exactly what DCP's flattening yields, in its order, for the
    containers DCP treats alike or apart: lists of scalars and of lists kept whole, tuples
    kept whole even with tensors inside, lists walked when they hold a tensor or a dict."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from resilient_ckpt.async_ckpt import _structure

    t = torch.rand(2)
    states = [
        *_walk_states(),
        {"a": [[1, 2], [3.0]], "b": (t, 1), "c": [t, {"x": t, "y": [1]}], "d": [[t], 2]},
        {"groups": [{"params": [0, 1], "lr": 0.1}], "e": [], "f": ()},
    ]
    for state in states:
        structure = _structure.walk(state)
        assert structure is not None
        flat, _ = flatten_state_dict(state)
        assert len(flat) == len(structure.leaves), state
        assert all(a is b for a, b in zip(flat.values(), structure.leaves, strict=True))


def test_walk_key_changes_with_every_part_of_the_structure() -> None:
    """Keys, container types, sharing, leaf types and tensor layouts tell a structure apart
    (the key, and the tensors' check of the structure cache); plain values do not (they are
    returned apart, floats by their bits)."""
    from collections import OrderedDict

    from resilient_ckpt.async_ckpt import _structure

    shared = {"w": torch.rand(2)}
    base = {"m": {"w": torch.rand(2)}, "n": {"w": torch.rand(2)}, "s": 1, "l": [1, 2]}
    same = _structure.walk(base)
    assert same is not None and _same_structure(same, _structure.walk({**base, "s": 2}))
    variants = [
        {**base, "x": 1},  # a key added
        {**base, "m": OrderedDict(base["m"])},  # a container's type
        {**base, "m": shared, "n": shared},  # sharing
        {**base, "s": 1.0},  # a leaf's type
        {**base, "m": {"w": torch.rand(3)}},  # a shape
        {**base, "m": {"w": torch.rand(2).double()}},  # a dtype
        {**base, "m": {"w": torch.rand(4)[::2]}},  # a stride
        {**base, "l": [1, 2, 3]},  # a list's length
    ]
    for variant in variants:
        assert not _same_structure(same, _structure.walk(variant)), variant
    values = _structure.walk({"a": 0.0, "b": [-0.0]})
    assert values is not None and values.values == [(0.0).hex(), (-0.0).hex()]

    class Sub(torch.Tensor):
        pass

    # Another tensor type is described apart (its type, shape, dtype, ...), never plain.
    sub = _structure.walk({"a": [torch.rand(2).as_subclass(Sub)]})
    assert sub is not None and not sub.plain
    assert not _same_structure(sub, _structure.walk({"a": [torch.rand(2)]}))
    assert not _same_structure(sub, _structure.walk({"a": [torch.rand(3).as_subclass(Sub)]}))
    assert _structure.walk([1, 2]) is None  # not a mapping


@pytest.mark.timeout(120)
def test_dcp_saves_of_get_state_dict_model_and_optimizer_restore_exactly(tmp_path) -> None:
    """The usual DCP state, ``get_state_dict(model, optimizer)`` (its param_groups a list of
    dicts, new objects every call), saved three times, restores exactly."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    cache = CheckpointMetadataCache()
    queue = AsyncCallsQueue()
    try:
        for n in range(3):
            model(torch.rand(3, 4)).sum().backward()
            optim.step()
            optim.param_groups[0]["lr"] *= 0.5
            model_sd, optim_sd = get_state_dict(model, optim)
            expected = _clone_nested({"model": model_sd, "optim": optim_sd})
            _dcp_save(
                queue, {"model": model_sd, "optim": optim_sd, "step": n}, tmp_path / f"s{n}", cache
            )
            queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    finally:
        queue.close()
    torch.manual_seed(1)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    model_sd, optim_sd = get_state_dict(fresh, fresh_optim)
    target = {"model": model_sd, "optim": optim_sd, "step": 0}
    dcp.load(target, checkpoint_id=str(tmp_path / "s2"))
    set_state_dict(
        fresh, fresh_optim, model_state_dict=target["model"], optim_state_dict=target["optim"]
    )
    got_model, got_optim = get_state_dict(fresh, fresh_optim)
    _same_nested(expected, {"model": got_model, "optim": got_optim})
    assert target["step"] == 2
