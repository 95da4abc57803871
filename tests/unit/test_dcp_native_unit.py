"""``resilient_ckpt.dcp`` in one process: torch's signatures, the arguments it refuses (named),
the ``Stager``'s own behaviour and the writer's pickling (issue 48)."""

from __future__ import annotations

import collections
import inspect
import pickle
import subprocess
import sys
from concurrent.futures import Future

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions

import resilient_ckpt.dcp as rdcp
from resilient_ckpt import _torch_compat
from resilient_ckpt.errors import ConfigurationError, StagingError


@pytest.mark.parametrize("ours, theirs", [(rdcp.async_save, dcp.async_save), (rdcp.save, dcp.save)])
def test_signatures_are_torchs(ours, theirs) -> None:
    mine, torchs = inspect.signature(ours).parameters, inspect.signature(theirs).parameters
    assert list(mine) == list(torchs)
    for name, param in torchs.items():
        assert mine[name].kind == param.kind, name
        assert mine[name].default == param.default, name


class _OwnStager(AsyncStager):
    def stage(self, state_dict):  # type: ignore[no-untyped-def]
        return state_dict


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"use_collectives": False}, "use_collectives"),
        ({"storage_writer": dcp.FileSystemWriter("/tmp/x")}, "storage_writer"),
        ({"async_stager": _OwnStager()}, "async_stager"),
        ({"async_stager": object()}, "async_stager"),
        ({"async_checkpointer_type": "fork"}, "async_checkpointer_type"),
        ({"checkpoint_id": None}, "checkpoint_id"),
    ],
)
def test_what_the_engine_cannot_honour_is_refused_by_name(kwargs, named) -> None:
    kwargs.setdefault("checkpoint_id", "/tmp/never_written")
    with pytest.raises(ConfigurationError, match=named):
        rdcp.async_save({"w": torch.ones(2)}, **kwargs)


def test_default_stager_mode_and_its_fallback() -> None:
    assert not _torch_compat.default_stager_is_async(
        DefaultStager(StagingOptions(False, False, False, False))
    )
    background = DefaultStager(StagingOptions(False, False, True, False))
    assert _torch_compat.default_stager_is_async(background)
    background.close()

    class Bare:  # a release without _config: the staging executor tells
        _staging_executor = object()

    assert _torch_compat.default_stager_is_async(Bare())
    assert not _torch_compat.default_stager_is_async(object())


Pair = collections.namedtuple("Pair", "a b")


def test_stager_snapshots_in_shared_memory_and_keeps_the_structure() -> None:
    stager = rdcp.Stager()
    source = {
        "w": torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
        "nested": collections.OrderedDict(x=[torch.ones(3, dtype=torch.int8), 5]),
        "pair": Pair(torch.zeros(2, dtype=torch.float64), "text"),
        "scalar": torch.tensor(7),
    }
    staged = stager.stage(source)
    assert isinstance(staged, dict) and isinstance(staged["nested"], collections.OrderedDict)
    assert isinstance(staged["pair"], Pair) and staged["pair"].b == "text"
    assert torch.equal(staged["w"], source["w"]) and torch.equal(staged["scalar"], source["scalar"])
    assert staged["w"].untyped_storage().is_shared()
    source["w"].add_(1)  # a snapshot: training may change the source
    assert not torch.equal(staged["w"], source["w"])
    assert stager.arena_count == 1
    del staged
    stager.stage(source)  # the first arena is free again: reused
    assert stager.arena_count == 1
    stager.close()
    stager.close()
    with pytest.raises(StagingError, match="close"):
        stager.stage(source)


def test_stager_bounds_its_arenas_and_names_max_arenas() -> None:
    stager = rdcp.Stager(max_arenas=1)
    stager._wait_s = 0.2
    held = stager.stage({"w": torch.ones(1000)})
    with pytest.raises(StagingError, match="max_arenas"):
        stager.stage({"w": torch.ones(1000)})
    del held
    assert torch.equal(stager.stage({"w": torch.ones(1000)})["w"], torch.ones(1000))
    stager.close()


def test_stager_async_staging_answers_a_future() -> None:
    stager = rdcp.Stager(async_staging=True)
    future = stager.stage({"w": torch.ones(4)})
    assert isinstance(future, Future)
    stager.synchronize_staging()
    assert torch.equal(future.result()["w"], torch.ones(4))
    stager.close()
    stager.close()


@pytest.mark.parametrize("bad", [{"max_arenas": 0}, {"async_staging": 1}])
def test_stager_options_are_checked(bad) -> None:
    with pytest.raises(ConfigurationError, match=next(iter(bad))):
        rdcp.Stager(**bad)


def test_writer_pickles_for_the_process_executor(tmp_path) -> None:
    writer = rdcp.FileSystemWriter(tmp_path / "ckpt", thread_count=2)
    copy = pickle.loads(pickle.dumps(writer))
    assert type(copy) is rdcp.FileSystemWriter and copy.thread_count == 2
    assert copy.checkpoint_id == str(tmp_path / "ckpt")


def test_single_process_async_save_and_save_round_trip(tmp_path) -> None:
    state = {"w": torch.randn(64, 8), "step": 3}
    first = rdcp.async_save(state, checkpoint_id=tmp_path / "a")
    assert isinstance(first, Future)
    rdcp.save(state, checkpoint_id=tmp_path / "b")  # commits the first save too
    assert first.done()
    rdcp.close()
    for name in ("a", "b"):
        target = {"w": torch.zeros(64, 8), "step": 0}
        dcp.load(target, checkpoint_id=tmp_path / name)
        assert torch.equal(target["w"], state["w"]) and target["step"] == 3


def test_dtensor_around_keeps_the_shard_in_place_and_its_fallback_agrees() -> None:
    """The private constructor and the public ``from_local`` fallback give the same DTensor
    around the given shard (on a CPU mesh, where ``from_local`` moves nothing)."""
    code = """
import torch, torch.distributed as dist
from resilient_ckpt import _torch_compat as c
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
mesh = init_device_mesh("cpu", (1,))
source = DTensor.from_local(torch.arange(6.0).reshape(3, 2), mesh, [Shard(0)], run_check=False)
class NoSpec:  # a release without _spec: the public path
    from_local = staticmethod(DTensor.from_local)
    def __init__(self, d):
        self.device_mesh, self.placements, self.shape = d.device_mesh, d.placements, d.shape
        self.stride = d.stride
shard = torch.ones(3, 2)
built = c.dtensor_around(source, shard)
assert type(built) is DTensor and built.to_local().data_ptr() == shard.data_ptr()
fallback = c.dtensor_around(NoSpec(source), shard)
assert type(fallback) is DTensor
for a in (built, fallback):
    assert (a.placements, a.shape, a.stride(), a.device_mesh) == (
        source.placements, source.shape, source.stride(), source.device_mesh)
    assert torch.equal(a.to_local(), shard)
    assert not a.requires_grad
dist.destroy_process_group()
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
