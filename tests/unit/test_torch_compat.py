"""Each private torch name the package uses, and the public-API fallback ``_torch_compat``
takes where torch drops it: the fallback gives what the private name gives.

The private names imported here are the reference the fallbacks and the public
replacements are checked against (tests may name them; the library may not, outside
``_torch_compat``).
"""

from __future__ import annotations

import io
import pickle
import subprocess
import sys
import traceback
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as torch_fs
from torch.distributed.checkpoint import DefaultSavePlanner

from resilient_ckpt import _rank_errors, _torch_compat
from tests._helpers import torch_serial_layout

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::UserWarning")]


def _state() -> dict:
    return {
        "w": torch.arange(300, dtype=torch.float32).reshape(10, 30),
        "b": torch.ones(7, dtype=torch.bfloat16),
        "view": torch.arange(100.0)[10:30],
        "nested": {"m": torch.full((5,), 2.0), "lst": [torch.zeros(3, dtype=torch.int64), 4]},
        "step": 7,
        "name": "model",
    }


def _write_all(write, transforms) -> tuple[bytes, list]:
    """Every item of ``_state()``'s local plan written with ``write``, after a prefix."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(_state(), is_coordinator=True)
    stream = io.BytesIO()
    stream.write(b"prefix")
    results = []
    for item in planner.create_local_plan().items:
        data = planner.resolve_data(item)
        if isinstance(data, torch.Tensor):
            data = data.detach().clone()
        results.append(write(transforms, stream, data, item, "__0_0.distcp"))
    return stream.getvalue(), results


# -- DCP data files ---------------------------------------------------------------------------


def test_write_item_fallback_writes_the_same_bytes_and_results(monkeypatch) -> None:
    transforms = getattr(dcp.FileSystemWriter("unused-path"), "transforms", None)
    private = _write_all(_torch_compat._write_item.__wrapped__(), transforms)
    assert private == _write_all(_torch_compat._write_item_public, transforms)

    monkeypatch.delattr(torch_fs, "_write_item")
    assert _torch_compat._write_item.__wrapped__() is _torch_compat._write_item_public


def test_storage_info_fallback_has_torch_fields_and_pickled_state(monkeypatch) -> None:
    private = _torch_compat.storage_info("__0_0.distcp", 6, 42)
    monkeypatch.delattr(torch_fs, "_StorageInfo")
    fallback_cls = _torch_compat._storage_info_class.__wrapped__()
    assert fallback_cls is _torch_compat._StorageInfo
    fallback = fallback_cls("__0_0.distcp", 6, 42)
    for field in ("relative_path", "offset", "length", "transform_descriptors"):
        assert getattr(fallback, field) == getattr(private, field, None)
    assert fallback.__getstate__() == private.__getstate__()


def test_dcp_save_with_every_file_fallback_is_byte_identical_and_loads(
    tmp_path, monkeypatch
) -> None:
    from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync

    state = _state()
    with warnings.catch_warnings(), torch_serial_layout():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "ref")))
    monkeypatch.setattr(_torch_compat, "_write_item", lambda: _torch_compat._write_item_public)
    monkeypatch.setattr(_torch_compat, "_storage_info_class", lambda: _torch_compat._StorageInfo)
    monkeypatch.setattr(
        _torch_compat, "_storage_prefix_class", lambda: _torch_compat._StoragePrefix
    )
    dcp.save(state, storage_writer=FileSystemWriterAsync(str(tmp_path / "ours"), thread_count=1))
    ours = (tmp_path / "ours" / "__0_0.distcp").read_bytes()
    assert ours == (tmp_path / "ref" / "__0_0.distcp").read_bytes()
    target = _state()
    for value in (target["w"], target["b"], target["nested"]["m"]):
        value.zero_()
    dcp.load(target, checkpoint_id=str(tmp_path / "ours"))
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
    assert torch.equal(target["nested"]["m"], state["nested"]["m"])


def test_storage_prefix_fallback_names_the_same_prefix(monkeypatch) -> None:
    torch_prefix = torch_fs._StoragePrefix("__3_")
    assert _torch_compat.prefix_of(torch_prefix) == "__3_"
    assert _torch_compat.prefix_of(_torch_compat.storage_prefix("__1_")) == "__1_"
    assert type(_torch_compat.storage_prefix("__1_")) is torch_fs._StoragePrefix
    assert _torch_compat.prefix_of(None) is None

    monkeypatch.delattr(torch_fs, "_StoragePrefix")
    fallback_cls = _torch_compat._storage_prefix_class.__wrapped__()
    assert fallback_cls is _torch_compat._StoragePrefix
    monkeypatch.setattr(_torch_compat, "_storage_prefix_class", lambda: fallback_cls)
    # torch's own prepare_global_plan would make torch's (renamed) class: its prefix counts.
    assert _torch_compat.prefix_of(torch_prefix) == "__3_"
    assert _torch_compat.prefix_of(_torch_compat.storage_prefix("__1_")) == "__1_"
    assert _torch_compat.prefix_of(None) is None


def test_storage_type_dtypes_fallback_is_torch_table(monkeypatch) -> None:
    private = _torch_compat._storage_type_dtypes.__wrapped__()
    assert private == {n: d for d, n in torch.storage._dtype_to_storage_type_map().items()}
    monkeypatch.delattr(torch.storage, "_dtype_to_storage_type_map")
    assert _torch_compat._storage_type_dtypes.__wrapped__() == private


# -- state dict values ------------------------------------------------------------------------


def test_sharded_tensor_fallback_sees_none(monkeypatch) -> None:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    assert _torch_compat._sharded_tensor_class.__wrapped__() is ShardedTensor
    values = [torch.zeros(2), {"a": 1}, None, torch.nn.Parameter(torch.ones(1))]
    private = [_torch_compat.is_sharded_tensor(v) for v in values]
    monkeypatch.setitem(sys.modules, "torch.distributed._shard.sharded_tensor", None)
    assert _torch_compat._sharded_tensor_class.__wrapped__() is None
    monkeypatch.setattr(_torch_compat, "_sharded_tensor_class", lambda: None)
    assert [_torch_compat.is_sharded_tensor(v) for v in values] == private == [False] * 4


def test_item_sizes_use_public_itemsize() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.complex64, torch.bool, torch.int8):
        assert dtype.itemsize == torch._utils._element_size(dtype)


def test_narrow_is_torch_narrowing() -> None:
    from torch.distributed._shard._utils import narrow_tensor_by_index

    from resilient_ckpt.async_ckpt._dcp_items import _narrow

    tensor = torch.arange(60.0).reshape(3, 4, 5)
    for offsets, sizes in [((0, 0, 0), (3, 4, 5)), ((1, 0, 2), (2, 4, 3)), ((0, 3, 0), (3, 1, 5))]:
        assert torch.equal(
            _narrow(tensor, offsets, sizes), narrow_tensor_by_index(tensor, offsets, sizes)
        )


# -- failures -----------------------------------------------------------------------------


def _failed() -> BaseException:
    try:
        raise RuntimeError("disk on fire")
    except RuntimeError as exc:
        return exc


def test_failure_pairs_match_torch() -> None:
    from torch.distributed.checkpoint.api import _is_wrapped_exception, _wrap_exception

    exc = _failed()
    ours, theirs = _rank_errors.local_failure(exc), _wrap_exception(exc)
    assert ours[0] is theirs[0]
    assert [(f.filename, f.lineno, f.name) for f in ours[1]] == [
        (f.filename, f.lineno, f.name) for f in theirs[1]
    ]
    pickle.dumps(ours)
    samples = [ours, theirs, (exc, []), (exc,), [exc, traceback.StackSummary()], None, (1, 2)]
    assert [_rank_errors.is_wrapped_failure(s) for s in samples] == [
        _is_wrapped_exception(s) for s in samples
    ]


# -- unpickling staged tensors ----------------------------------------------------------------


def test_sparse_validation_and_its_fallback() -> None:
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,))
    _torch_compat.validate_loaded_sparse_tensors()
    loaded = pickle.loads(pickle.dumps(sparse))
    assert len(_torch_compat.pending_sparse_tensors()) == 1
    _torch_compat.validate_loaded_sparse_tensors()
    assert _torch_compat.pending_sparse_tensors() == []
    assert torch.equal(loaded.to_dense(), sparse.to_dense())


def test_sparse_fallback_when_torch_keeps_no_list(monkeypatch) -> None:
    monkeypatch.delattr(torch._utils, "_sparse_tensors_to_validate")
    monkeypatch.delattr(torch._utils, "_validate_loaded_sparse_tensors")
    assert _torch_compat.pending_sparse_tensors() == []
    _torch_compat.validate_loaded_sparse_tensors()  # nothing queued, nothing to do


# -- CUDA ---------------------------------------------------------------------------------


def test_cuda_devices_with_context_and_fallback(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda d: d == 1, raising=False)
    private = _torch_compat.cuda_devices_with_context()
    monkeypatch.delattr(torch._C, "_cuda_hasPrimaryContext")
    assert _torch_compat.cuda_devices_with_context() == private == [1]
    # With contexts on other devices the fallback knows only the current one; a copy from
    # another device then waits for that device in full (async_ckpt/_copy.py).
    monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda d: d < 2, raising=False)
    assert _torch_compat.cuda_devices_with_context() == [0, 1]


# -- weights_only loads ------------------------------------------------------------------------


class _Unsafe:
    """A class no one marked safe."""


def test_unsafe_globals_in_an_archive_and_where_it_cannot_tell(monkeypatch) -> None:
    buffer = io.BytesIO()
    torch.save({"a": _Unsafe(), "t": torch.ones(2)}, buffer)
    buffer.seek(0)
    assert _torch_compat.unsafe_globals_in(buffer) == [f"{__name__}._Unsafe"]
    legacy = io.BytesIO()
    torch.save({"a": _Unsafe()}, legacy, _use_new_zipfile_serialization=False)
    legacy.seek(0)
    assert _torch_compat.unsafe_globals_in(legacy) is None  # not an archive
    buffer.seek(0)
    monkeypatch.delattr(torch.serialization, "get_unsafe_globals_in_checkpoint", raising=False)
    assert _torch_compat.unsafe_globals_in(buffer) is None  # torch 2.4


# -- the command line's whole-checkpoint load -------------------------------------------------


def test_cli_load_dcp_matches_torch_dcp_to_torch_save(tmp_path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from resilient_ckpt.cli.conversion import load_dcp

    state = _state()
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"), **_torch_compat.no_dist_kwargs(dcp.save))
    dcp_to_torch_save(str(tmp_path / "ckpt"), str(tmp_path / "ref.pt"))
    expected = torch.load(str(tmp_path / "ref.pt"), weights_only=False)
    seen: list[int] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the single-process load warns no one
        loaded = load_dcp(str(tmp_path / "ckpt"), seen.append)
    assert sum(seen) > 0
    buffer_a, buffer_b = io.BytesIO(), io.BytesIO()
    torch.save(loaded, buffer_a)
    torch.save(expected, buffer_b)
    assert buffer_a.getvalue() == buffer_b.getvalue()


def test_importing_compat_leaves_dtensor_for_first_use() -> None:
    code = (
        "import sys, resilient_ckpt._torch_compat as c\n"
        "assert 'torch.distributed.tensor' not in sys.modules\n"
        "from resilient_ckpt._torch_compat import DTensor, Shard\n"
        "import torch.distributed.tensor as t\n"
        "assert DTensor is t.DTensor and Shard is t.Shard and c.Replicate is t.Replicate\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_dtensor_specs_and_their_public_fallback_tell_the_same_changes() -> None:
    """The private spec and the public fields agree on which DTensors plan alike; before
    DTensor's module is imported, no DTensor is looked for."""
    code = """
import sys, torch, torch.distributed as dist
from resilient_ckpt import _torch_compat as c
assert c.loaded_dtensor() is None and c.dtensor_specs([]) == []
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
assert c.loaded_dtensor() is DTensor
mesh = init_device_mesh("cpu", (1,))
def make(rows, placement):
    return DTensor.from_local(torch.zeros(rows, 2), mesh, [placement], run_check=False)
a, same, other_shape, other_placement = (
    make(4, Shard(0)), make(4, Shard(0)), make(5, Shard(0)), make(4, Replicate()))
for read in (c._dtensor_spec.__wrapped__(), None):
    if read is None:
        c.loaded_dtensor = lambda: type("NoSpec", (), {})
        read = c._dtensor_spec.__wrapped__()
        assert read.__name__ == "public"
    ref = read(a)
    assert read(same) == ref and read(other_shape) != ref and read(other_placement) != ref
dist.destroy_process_group()
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_tensor_check_by_torch_guard_and_by_its_fallback_tell_the_same_changes(
    monkeypatch,
) -> None:
    """The structure's tensor check answers alike through torch's guard and through the
    fields read from Python, for each field of a tensor's description; a tensor object met
    twice and tensors that are not strided take the fallback or are refused."""
    from resilient_ckpt.async_ckpt._structure import TensorCheck

    base = [torch.zeros(4), torch.zeros(2, 3), torch.zeros(2, dtype=torch.complex64)]
    changed = [
        [torch.zeros(5), base[1], base[2]],  # shape
        [torch.zeros(4, dtype=torch.int32), base[1], base[2]],  # dtype of the same size
        [torch.zeros(4, requires_grad=True), base[1], base[2]],  # requires_grad
        [torch.nn.Parameter(torch.zeros(4), requires_grad=False), base[1], base[2]],  # type
        [torch.zeros(4, device="meta"), base[1], base[2]],  # device
        [base[0], torch.zeros(3, 2).t(), base[2]],  # stride
        [base[0], base[1], base[2].conj()],  # conjugate bit
        [base[0], base[1]],  # count
    ]
    same = [torch.ones(4), torch.ones(2, 3), torch.ones(2, dtype=torch.complex64)]
    answers = []
    for guard in (True, False):
        if not guard:
            monkeypatch.setattr(_torch_compat, "_guard_maker", lambda: None)
        assert (_torch_compat.tensor_guard(base) is not None) is guard
        check = TensorCheck(base)
        answers.append([check.matches(same), *map(check.matches, changed)])
    assert answers[0] == answers[1] == [True] + [False] * len(changed)
    assert _torch_compat.tensor_guard([base[0], base[0]]) is None  # refused by the guard
    assert TensorCheck([base[0], base[0]]).matches([same[0], same[0]])
    with pytest.raises(ValueError, match="not strided"):
        TensorCheck([torch.zeros(4).to_sparse()])
