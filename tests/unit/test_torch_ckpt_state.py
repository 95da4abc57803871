"""The torch.save flow writes what ``torch.save`` writes: the same archive (pickle and
storages) for a training state with tied weights, a module ``state_dict()``'s ``_metadata``,
objects met twice staying one object, and every change saved (issue 33: a drop-in writes
torch.save's archive, with its dicts of tensors staged as one batch or not)."""

from __future__ import annotations

import zipfile
from collections import OrderedDict

import pytest
import torch

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


@pytest.mark.timeout(120)
def test_torch_flow_writes_torch_saves_bytes_after_a_warmup_and_each_change(tmp_path) -> None:
    model, state = _training_state(1)
    ckpt = TorchAsyncCheckpoint()
    try:
        ckpt.warmup(state)
        for step in range(1, 4):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.5)  # in place: the state_dict's tensors see it
            state["step"] = step
            (tmp_path / "ref").mkdir(exist_ok=True)
            (tmp_path / "ours").mkdir(exist_ok=True)
            torch.save(state, tmp_path / "ref" / f"{step}.pt")
            overlap = step == 2  # staged on the background thread once
            ckpt.async_save(state, str(tmp_path / "ours" / f"{step}.pt"), overlap_staging=overlap)
            ckpt.wait_for_snapshot()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(100.0)  # after the snapshot: not in the checkpoint
            ckpt.finalize_async_save(blocking=True)
            with torch.no_grad():
                for p in model.parameters():
                    p.sub_(100.0)
            ours = _records(tmp_path / "ours" / f"{step}.pt")
            assert ours == _records(tmp_path / "ref" / f"{step}.pt")
        loaded = torch.load(tmp_path / "ours" / "3.pt", weights_only=False)
        assert type(loaded["model"]) is OrderedDict
        assert loaded["model"]._metadata == state["model"]._metadata  # the module versions
        assert (
            loaded["model"]["head.weight"].data_ptr() == loaded["model"]["embed.weight"].data_ptr()
        )
        # A changed structure: a tensor replaced by one in other memory, then a key added.
        for change in (
            lambda s: s["model"].__setitem__("norm.bias", torch.full((16,), 7.0)),
            lambda s: s["model"].__setitem__("extra", torch.arange(5.0)),
        ):
            change(state)
            path = tmp_path / f"changed{len(state['model'])}.pt"
            ckpt.async_save(state, str(path))
            ckpt.finalize_async_save(blocking=True)
            got = torch.load(path, weights_only=False)["model"]
            assert list(got) == list(state["model"])
            for key, value in state["model"].items():
                assert torch.equal(got[key], value), key
    finally:
        ckpt.close()


@pytest.mark.timeout(120)
def test_torch_flow_keeps_objects_met_twice_one_object(tmp_path) -> None:
    """A dict under two keys, and one tensor under many keys of a dict, load back as one
    object each, as from ``torch.save``; so does a tensor of a dict also held at top level,
    met before the dict."""
    weights = {f"w{i}": torch.full((3,), float(i)) for i in range(10)}
    repeated = OrderedDict((f"r{i}", weights["w0"]) for i in range(10))
    state = {"a": weights, "b": weights, "repeated": repeated}
    first = {"first": weights["w3"], "a": weights, "step": 4}
    ckpt = TorchAsyncCheckpoint()
    try:
        for name, saved in (("twice", state), ("first", first)):
            ckpt.async_save(saved, str(tmp_path / f"{name}.pt"))
            ckpt.finalize_async_save(blocking=True)
            torch.save(saved, tmp_path / f"{name}-ref.pt")
            assert _records(tmp_path / f"{name}.pt") == _records(tmp_path / f"{name}-ref.pt")
    finally:
        ckpt.close()
    loaded = torch.load(tmp_path / "twice.pt")
    assert loaded["a"] is loaded["b"]
    assert all(t is loaded["a"]["w0"] for t in loaded["repeated"].values())
    assert all(torch.equal(loaded["a"][k], v) for k, v in weights.items())
    loaded = torch.load(tmp_path / "first.pt")
    assert loaded["first"] is loaded["a"]["w3"]
