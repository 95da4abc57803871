"""Clear errors on every rank, never a hang, for requests that cannot be honoured.

Each failing call below fails on *every* rank with the cause (and the failing ranks), even
when only one rank has the problem: the library agrees on each step's outcome before the
next collective. The unwritable-root cases: the tests run as root, so permission bits do
not stop a write; a rank directory blocked by a regular *file* does, and so does a
read-only tmpfs (mounted by the test when the machine allows it, skipped otherwise).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess

import pytest

from resilient_ckpt.async_ckpt.core import AsyncCallsQueue
from resilient_ckpt.errors import (
    CheckpointingException,
    ConfigurationError,
    StorageError,
    WorkerError,
)
from resilient_ckpt.local import BasicTensorAwareStateDict, CliqueReplicationStrategy
from resilient_ckpt.local._background import wait_for_status
from resilient_ckpt.testing import launch

from .local_ckpt_utils import barrier, load_fresh, make_state, manager, rank_dir, strategy

pytestmark = pytest.mark.dist


def _raises(cls: type[BaseException], fn, *match: str) -> str:
    try:
        fn()
    except cls as exc:
        text = str(exc)
        for part in match:
            assert part in text, f"{part!r} not in {text!r}"
        return text
    raise AssertionError(f"{cls.__name__} not raised")


def _save(mgr, rank: int, iteration: int, **extra):
    state = make_state(rank, iteration)
    state["meta"].update(extra)
    return lambda: mgr.save(BasicTensorAwareStateDict(state), iteration)


def _bad_requests(rank: int, root: str) -> None:
    for jump, factor in ((1, 3), (3, 2)):
        _raises(
            ConfigurationError,
            lambda j=jump, f=factor: CliqueReplicationStrategy.from_replication_params(j, f),
            "divisible",
        )
    mgr = manager(os.path.join(root, "a"), None)
    _raises(CheckpointingException, mgr.load, "find_latest")
    _save(mgr, rank, 5)()
    for iteration in (5, 3):
        _raises(ConfigurationError, _save(mgr, rank, iteration), "not newer")
    _raises(ConfigurationError, _save(mgr, rank, 7 if rank == 0 else 6), "different iterations")
    extra = {"fn": lambda: 0} if rank == 2 else {}
    _raises(ConfigurationError, _save(mgr, rank, 8, **extra), "rank(s) [2]", "pickle")
    _save(mgr, rank, 8)()
    assert load_fresh(os.path.join(root, "a"), None)[0] == 8


def _unwritable(rank: int, root: str, ro_root: str | None) -> None:
    blocked = os.path.join(root, "b")
    if rank == 3:
        os.makedirs(os.path.dirname(rank_dir(blocked, 3)))
        with open(rank_dir(blocked, 3), "w") as f:
            f.write("a file where rank 3's directory should be")
    barrier()
    _raises(StorageError, _save(manager(blocked, None), rank, 1), "rank(s) [3]")
    if ro_root is not None:
        mgr = manager(ro_root, None)
        assert mgr.find_latest() == -1
        _raises(StorageError, _save(mgr, rank, 1), "not writable", "Read-only file system")


def _mismatched_manifests(rank: int, root: str) -> None:
    base = os.path.join(root, "c")
    narrow, wide = strategy((1, 2)), strategy((2, 2))
    manager(base, narrow).save(BasicTensorAwareStateDict(make_state(rank, 1)), 1)
    _raises(ConfigurationError, manager(base, wide).find_latest, "replication", "jump")
    assert load_fresh(base, None)[0] == 1  # without replication the replicas are ignored
    barrier()
    if rank == 1:
        directory = rank_dir(base, 1)
        for name in os.listdir(directory):
            if name.endswith(".manifest.json"):
                path = os.path.join(directory, name)
                fields = json.load(open(path))
                fields["world_size"] = 8
                with open(path, "w") as f:
                    json.dump(fields, f)
    barrier()
    _raises(ConfigurationError, manager(base, narrow).find_latest, "8 ranks", "this job has 4")


def _injected_failure(targets, sources) -> None:
    raise OSError("injected disk failure")


def _background_failure(rank: int, root: str) -> None:
    """A write failing in one rank's replication thread fails the request on every rank."""
    base = os.path.join(root, "d")
    mgr = manager(base, strategy((1, 2)))
    if rank == 1:
        real = mgr._write_request
        mgr._write_request = lambda it, ids: (_injected_failure, real(it, ids)[1])  # type: ignore[method-assign]
    queue = AsyncCallsQueue(persistent=False)
    request = mgr.save(BasicTensorAwareStateDict(make_state(rank, 1)), 1, is_async=True)
    assert request.async_fn is wait_for_status  # the replicated async path
    queue.schedule_async_request(request)
    finalize = functools.partial(queue.maybe_finalize_async_calls, blocking=True)
    _raises(WorkerError, finalize, "rank(s) [1]", "injected disk failure")
    queue.close()
    mgr._write_request = type(mgr)._write_request.__get__(mgr)  # type: ignore[method-assign]
    _save(mgr, rank, 2)()
    assert load_fresh(base, strategy((1, 2)))[0] == 2


def _errors(rank: int, world_size: int, root: str, ro_root: str | None) -> bool:
    _bad_requests(rank, root)
    _background_failure(rank, root)
    _unwritable(rank, root, ro_root)
    _mismatched_manifests(rank, root)
    return True


def _mount_read_only(path: str) -> bool:
    """A read-only tmpfs at ``path`` holding empty rank directories, if allowed here."""
    os.makedirs(path)
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", path], capture_output=True
        ).returncode
        != 0
    ):
        return False
    for rank in range(4):
        os.makedirs(rank_dir(path, rank))
    remount = ["mount", "-o", "remount,ro", path]
    if subprocess.run(remount, capture_output=True).returncode != 0:
        subprocess.run(["umount", path], capture_output=True)
        return False
    return True


def test_clear_errors_on_every_rank(tmp_path):
    ro_root = str(tmp_path / "ro")
    mounted = _mount_read_only(ro_root)
    try:
        results = launch(
            _errors, 4, str(tmp_path / "ckpt"), ro_root if mounted else None, timeout=150
        )
    finally:
        if mounted:
            subprocess.run(["umount", ro_root], capture_output=True)
    assert results == [True] * 4
    if not mounted:
        pytest.skip("read-only tmpfs case skipped: mount is not permitted here (rest passed)")
