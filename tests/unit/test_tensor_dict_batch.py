"""The torch.save flow stages a dict of tensors (a model's state_dict) as one batch
(``_staging.TensorDict``): same file as ``torch.save``, steady saves reuse the layout, and
every change is saved."""

from __future__ import annotations

import copy
import pickle
import zipfile
from collections import OrderedDict

import pytest
import torch

from resilient_ckpt.async_ckpt._staging import MIN_BATCHED, TensorDict, batch_tensor_dicts
from resilient_ckpt.async_ckpt.torch_ckpt import TorchAsyncCheckpoint


class _TiedLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.blocks = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)])
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight  # tied: two keys, one storage


def _training_state(step: int) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    model = _TiedLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = model.head(model.blocks(model.embed(torch.arange(4)))).sum()
    loss.backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
    return model, state


def _records(path) -> dict[str, bytes]:
    """A torch.save archive's records (the pickle, each storage) by name below the archive's
    top folder, which torch names after the file (ours writes a temporary name first)."""
    with zipfile.ZipFile(path) as archive:
        return {name.split("/", 1)[1]: archive.read(name) for name in archive.namelist()}


def test_state_is_batched_without_changing_the_callers_objects() -> None:
    _, state = _training_state(3)
    before = copy.copy(state)
    staged = batch_tensor_dicts(state)
    assert state == before and staged is not state
    assert isinstance(staged["model"], TensorDict)
    assert staged["optimizer"] is state["optimizer"]  # a dict of dicts: left as it is
    rebuilt = pickle.loads(pickle.dumps(staged))
    assert type(rebuilt["model"]) is OrderedDict
    assert list(rebuilt["model"]) == list(state["model"])
    assert rebuilt["model"]._metadata == state["model"]._metadata  # the module versions
    # Nothing to batch: the very object.
    small = {"a": torch.ones(2), "step": 1}
    assert batch_tensor_dicts(small) is small
    assert len(small) < MIN_BATCHED


def test_a_dict_met_twice_stays_one_object_and_repeated_tensors_are_not_batched() -> None:
    shared = {f"w{i}": torch.full((3,), float(i)) for i in range(MIN_BATCHED)}
    rebuilt = pickle.loads(pickle.dumps(batch_tensor_dicts({"a": shared, "b": shared})))
    assert rebuilt["a"] is rebuilt["b"]
    repeated = {f"w{i}": shared["w0"] for i in range(MIN_BATCHED)}
    assert batch_tensor_dicts({"m": repeated})["m"] is repeated


@pytest.mark.timeout(120)
def test_torch_flow_writes_torch_saves_bytes_and_reuses_the_batched_layout(tmp_path) -> None:
    model, state = _training_state(1)
    ckpt = TorchAsyncCheckpoint()
    try:
        ckpt.warmup(state)
        cache = ckpt.queue.persistent_caller.stage_cache
        for step in range(1, 4):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.5)  # in place: the state_dict's tensors see it
            state["step"] = step
            (tmp_path / "ref").mkdir(exist_ok=True)
            (tmp_path / "ours").mkdir(exist_ok=True)
            torch.save(state, tmp_path / "ref" / f"{step}.pt")
            hits = cache.hits
            overlap = step == 2  # the batch's checks then run on the staging thread
            ckpt.async_save(state, str(tmp_path / "ours" / f"{step}.pt"), overlap_staging=overlap)
            ckpt.wait_for_snapshot()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(100.0)  # after the snapshot: not in the checkpoint
            ckpt.finalize_async_save(blocking=True)
            with torch.no_grad():
                for p in model.parameters():
                    p.sub_(100.0)
            assert cache.hits == hits + 1  # steady: the warm-up's layout, batch included
            ours = _records(tmp_path / "ours" / f"{step}.pt")
            assert ours == _records(tmp_path / "ref" / f"{step}.pt")
        loaded = torch.load(tmp_path / "ours" / "3.pt", weights_only=False)
        assert (
            loaded["model"]["head.weight"].data_ptr() == loaded["model"]["embed.weight"].data_ptr()
        )
        # A changed structure: a tensor replaced by one in other memory, then a key added.
        for change in (
            lambda s: s["model"].__setitem__("norm.bias", torch.full((16,), 7.0)),
            lambda s: s["model"].__setitem__("extra", torch.arange(5.0)),
        ):
            change(state)
            hits = cache.hits
            path = tmp_path / f"changed{len(state['model'])}.pt"
            ckpt.async_save(state, str(path))
            ckpt.finalize_async_save(blocking=True)
            assert cache.hits == hits  # staged fully
            got = torch.load(path, weights_only=False)["model"]
            assert list(got) == list(state["model"])
            for key, value in state["model"].items():
                assert torch.equal(got[key], value), key
    finally:
        ckpt.close()
