"""Seeded, bounded fuzz of every checkpoint file kind through each of our readers.

For each kind of file (DCP metadata and data, local shard and manifest, the tiered memory
tier's commit record, a ``torch.save`` file) a valid checkpoint is written once; then each
case copies it, damages that one file (bytes flipped, or cut short) and runs every reader
of ours that reads it: the library's readers and managers, and the ``resilient-ckpt``
command. A reader may succeed (a flipped byte in tensor data that no checksum covers reads
back as another value) or fail with one of our named errors; the command may exit 0, 1 or
2 but never print a traceback. Anything else (another exception type, a hang, a crash of
the process, code run from the file) fails the test. Each kind runs in a rank process of
its own (the tiered manager needs a process group), so a crash is seen as one, and the
rank returns its unexpected outcomes as plain strings that the assertion prints.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import pickle
import random
import shutil
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from resilient_ckpt.testing import launch
from tests._helpers import RunsCode

pytestmark = pytest.mark.timeout(240)

SEED = 37
CASES = 12  # damaged copies of each file kind; each runs every reader of that kind
MARKER = "code-ran"


def _damages(rng: random.Random, size: int, n: int) -> Iterator[tuple[str, Callable]]:
    """``n`` seeded damages of a file of ``size`` bytes: half byte flips, half truncations."""
    for i in range(n):
        if i % 2 == 0:
            offsets = sorted(rng.randrange(size) for _ in range(rng.choice((1, 2, 8))))

            def flip(data: bytes, offsets: list[int] = offsets) -> bytes:
                out = bytearray(data)
                for at in offsets:
                    out[at] ^= 1 << (at % 8)
                return bytes(out)

            yield f"flip@{offsets}", flip
        else:
            cut = rng.randrange(size)
            yield f"cut@{cut}", lambda data, cut=cut: data[:cut]


def _named(exc: BaseException) -> bool:
    from torch.distributed.checkpoint import CheckpointException

    from resilient_ckpt.errors import CheckpointingException

    if isinstance(exc, CheckpointingException):
        return True
    # dcp.load reports the ranks' failures in torch's CheckpointException: each must be ours.
    if isinstance(exc, CheckpointException):
        return all(_named(e) for e in exc.failures.values() if isinstance(e, BaseException))
    return False


def _call(label: str, fn: Callable[[], Any], problems: list[str]) -> None:
    try:
        fn()
    except BaseException as exc:  # classifying every outcome is the point
        if not _named(exc):
            problems.append(f"{label}: {type(exc).__name__}: {exc}"[:400])


def _cli(label: str, argv: list[str], problems: list[str]) -> None:
    from resilient_ckpt.cli import main

    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = main(argv)
    except SystemExit as exc:
        code = exc.code
    except BaseException as exc:
        problems.append(f"{label}: {' '.join(argv[:1])} raised {type(exc).__name__}: {exc}"[:400])
        return
    if code not in (0, 1, 2, None) or "Traceback" in err.getvalue():
        problems.append(f"{label}: {' '.join(argv[:1])} exit {code}: {err.getvalue()[-300:]}")


def _state(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 32, generator=gen),
        "b": torch.randn(32, generator=gen).to(torch.bfloat16),
        "nested": {"i": torch.arange(100), "note": "text"},
        "step": 3,
    }


# -- writers of each kind, and the readers of each ------------------------------------------


def _write_dcp(root: str) -> str:
    import torch.distributed.checkpoint as dcp

    from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync

    path = os.path.join(root, "dcp")
    dcp.save(_state(1), storage_writer=FileSystemWriterAsync(path, thread_count=1))
    return path


def _read_dcp(path: str, label: str, problems: list[str]) -> None:
    import torch.distributed.checkpoint as dcp

    from resilient_ckpt.async_ckpt.cached_metadata_filesystem_reader import (
        CachedMetadataFileSystemReader,
    )
    from resilient_ckpt.async_ckpt.verify import verify_checkpoint

    _call(
        f"{label} read_metadata",
        lambda: CachedMetadataFileSystemReader(path).read_metadata(),
        problems,
    )
    target = _state(2)
    _call(
        f"{label} dcp.load",
        lambda: dcp.load(target, storage_reader=CachedMetadataFileSystemReader(path)),
        problems,
    )
    _call(f"{label} verify_checkpoint", lambda: verify_checkpoint(path), problems)
    for argv in (["ls", os.path.dirname(path)], ["verify", path], ["inspect", path]):
        _cli(label, argv, problems)
    _cli(label, ["convert", path, os.path.join(os.path.dirname(path), "out.pt")], problems)


def _write_local(root: str) -> str:
    from resilient_ckpt.local import BasicTensorAwareStateDict, LocalCheckpointManager

    LocalCheckpointManager(root, "s").save(BasicTensorAwareStateDict(_state(1)), 1)
    return root


def _read_local(root: str, label: str, problems: list[str]) -> None:
    from resilient_ckpt.local import LocalCheckpointManager

    def load(weights_only: bool) -> None:
        manager = LocalCheckpointManager(root, "s", weights_only=weights_only)
        if manager.find_latest() != -1:
            manager.load()

    for safe in (False, True):
        _call(f"{label} LocalCheckpointManager.load", functools.partial(load, safe), problems)
    for argv in (["ls", root], ["verify", root], ["inspect", root]):
        _cli(label, argv, problems)


def _write_tiered(root: str) -> str:
    from resilient_ckpt.tiered import TieredCheckpointManager

    manager = TieredCheckpointManager(
        os.path.join(root, "mem"),
        os.path.join(root, "durable"),
        durable_every=1,
        replication_factor=1,
    )
    manager.save(_state(1), 1)
    manager.maybe_finalize(blocking=True)
    manager.close()
    return root


def _read_tiered(root: str, label: str, problems: list[str]) -> None:
    from resilient_ckpt.tiered import TieredCheckpointManager

    def restore() -> None:
        manager = TieredCheckpointManager(
            os.path.join(root, "mem"),
            os.path.join(root, "durable"),
            durable_every=1,
            replication_factor=1,
        )
        try:
            manager.load(_state(2))
        finally:
            manager.close()

    _call(f"{label} TieredCheckpointManager.load", restore, problems)
    mem, durable = os.path.join(root, "mem"), os.path.join(root, "durable")
    _cli(label, ["ls", mem, durable, "--verify"], problems)


def _write_torch(root: str) -> str:
    path = os.path.join(root, "model.pt")
    torch.save(_state(1), path)
    return path


def _read_torch(path: str, label: str, problems: list[str]) -> None:
    for argv in (["ls", os.path.dirname(path)], ["verify", path], ["inspect", path]):
        _cli(label, argv, problems)
    _cli(label, ["convert", path, os.path.join(os.path.dirname(path), "out")], problems)


def _find(top: str, pick: Callable[[str], bool]) -> str:
    for parent, _, names in sorted(os.walk(top)):
        for name in sorted(names):
            if pick(name):
                return os.path.join(parent, name)
    raise AssertionError(f"no file to damage under {top}: {sorted(os.listdir(top))}")


# kind: (writer, reader, the file the cases damage, whether that file is a pickle)
KINDS: dict[str, tuple[Callable, Callable, Callable[[str], bool], bool]] = {
    "dcp-metadata": (_write_dcp, _read_dcp, lambda n: n == ".metadata", True),
    "dcp-data": (_write_dcp, _read_dcp, lambda n: n.endswith(".distcp"), False),
    "local-shard": (_write_local, _read_local, lambda n: n.endswith("_local.pt"), False),
    "local-manifest": (_write_local, _read_local, lambda n: n.endswith(".manifest.json"), False),
    "tiered-record": (_write_tiered, _read_tiered, lambda n: n == ".metadata", True),
    "torch-file": (_write_torch, _read_torch, lambda n: n.endswith(".pt"), False),
}


def _fuzz(rank: int, world: int, kind: str, root: str) -> list[str]:
    """Every unexpected outcome of ``kind``'s cases (run in a rank process)."""
    write, read, pick, is_pickle = KINDS[kind]
    warnings.simplefilter("ignore")
    pristine = os.path.join(root, "pristine")
    os.makedirs(pristine)
    written = write(pristine)
    top = pristine if kind != "tiered-record" else os.path.join(pristine, "mem")
    victim = os.path.relpath(_find(top, pick), pristine)
    with open(os.path.join(pristine, victim), "rb") as f:
        data = f.read()
    rng = random.Random(f"{SEED}-{kind}")
    cases = list(_damages(rng, len(data), CASES))
    marker = os.path.join(root, MARKER)
    if is_pickle:
        cases.append(("code", lambda _: pickle.dumps(RunsCode(marker))))
    problems: list[str] = []
    for i, (label, damage) in enumerate(cases):
        case = os.path.join(root, f"case{i}")
        shutil.copytree(pristine, case)
        with open(os.path.join(case, victim), "wb") as f:
            f.write(damage(data))
        read(os.path.join(case, os.path.relpath(written, pristine)), f"{victim} {label}", problems)
        shutil.rmtree(case)
    if os.path.exists(marker):
        problems.append(f"{victim}: a reader ran code from the file")
    return problems


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_damaged_files_get_named_errors_only(kind, tmp_path):
    (problems,) = launch(_fuzz, 1, kind, str(tmp_path), timeout=200)
    assert problems == []
