"""Listing (``resilient-ckpt ls`` / ``verify``) and retention on object stores and locally."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from resilient_ckpt.cli import checkpoints
from resilient_ckpt.cli import main as cli_main
from resilient_ckpt.storage import get_backend, list_checkpoints, prune_checkpoints

pytestmark = [pytest.mark.objstore, pytest.mark.timeout(120)]


def _save(path: str, seed: int) -> None:
    state = {"w": torch.full((16, 4), float(seed)), "step": seed}
    dcp.save(state, storage_writer=FileSystemWriterAsync(path, thread_count=2))


def _uncommit(path: str) -> None:
    backend = get_backend(path)
    backend.delete(backend.join(path, ".metadata"))


def _populate(root: str) -> None:
    """iteration-0..4 where 0 and 4 are uncommitted (a failed save, a save in progress)."""
    backend = get_backend(root)
    for it in range(5):
        _save(backend.join(root, f"iteration-{it:04d}"), it)
    _uncommit(backend.join(root, "iteration-0000"))
    _uncommit(backend.join(root, "iteration-0004"))
    backend.makedirs(backend.join(root, "notes"))
    with backend.open_write(backend.join(root, "notes", "model.pt")) as f:
        torch.save({"x": torch.ones(2)}, f)


def _check_listing_and_retention(root: str, capsys) -> None:
    _populate(root)
    refs = list_checkpoints(root)
    assert [(r.iteration, r.committed) for r in refs] == [
        (0, False),
        (1, True),
        (2, True),
        (3, True),
        (4, False),
    ]

    entries = checkpoints.discover(root, verify=True)
    dcp_entries = [e for e in entries if e.kind == "dcp"]
    assert [(e.iteration, e.complete) for e in dcp_entries] == [
        (i, i in (1, 2, 3)) for i in range(5)
    ]
    assert all(e.verified for e in dcp_entries if e.complete)
    assert all(e.world_size == 1 for e in dcp_entries if e.complete)
    assert all(e.nbytes > 16 * 4 * 4 for e in dcp_entries)
    torch_entries = [e for e in entries if e.kind == "torch"]
    assert [e.path.rsplit("/", 2)[-2:] for e in torch_entries] == [["notes", "model.pt"]]

    assert cli_main(["--json", "ls", root]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert len(listed) == 6 and {e["kind"] for e in listed} == {"dcp", "torch"}
    assert cli_main(["verify", root]) == 1  # the two uncommitted checkpoints fail
    assert "not committed" in capsys.readouterr().out

    deleted = prune_checkpoints(root, keep_latest=2)
    assert [d.rsplit("/", 1)[-1] for d in deleted] == ["iteration-0000", "iteration-0001"]
    assert [(r.iteration, r.committed) for r in list_checkpoints(root)] == [
        (2, True),
        (3, True),
        (4, False),  # newer than the newest committed one: maybe in progress, kept
    ]
    assert prune_checkpoints(root, keep_latest=2) == []


def test_listing_and_retention_on_object_store(msc_store, capsys) -> None:
    _check_listing_and_retention(msc_store.url(), capsys)
    assert not any(k.startswith(("iteration-0000", "iteration-0001")) for k in msc_store.keys())


def test_listing_and_retention_on_posix(tmp_path, capsys) -> None:
    _check_listing_and_retention(str(tmp_path / "ckpts"), capsys)
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == [
        "iteration-0002",
        "iteration-0003",
        "iteration-0004",
        "notes",
    ]


def test_prune_rejects_bad_keep_latest(tmp_path) -> None:
    from resilient_ckpt.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="keep_latest"):
        prune_checkpoints(str(tmp_path), keep_latest=0)
