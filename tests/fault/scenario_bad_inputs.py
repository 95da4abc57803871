"""Bad inputs across the API: a named error each, on every rank, and no hang.

Row of the matrix: "bad inputs (at least 20 kinds across the API)". A 2-rank gloo job
tries every case on both ranks. Most cases are local checks; the collective ones give the
bad input to *one* rank only (``rank1``), the way a real bug shows up, and every rank must
still raise (a rank that raised alone would leave its peers in a collective until the
deadline). Each case passes if it raised the expected class of the ``errors.py`` hierarchy
(``CheckpointingException``) with a message naming what was wrong, within ``CASE_S``.
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from resilient_ckpt import errors
from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from resilient_ckpt.async_ckpt.state_dict_saver import save_state_dict_async_plan
from resilient_ckpt.async_ckpt.torch_ckpt import TorchAsyncCheckpoint
from resilient_ckpt.async_ckpt.verify import verify_checkpoint
from resilient_ckpt.cli.checkpoints import discover
from resilient_ckpt.config import Timeouts, default_timeouts, local_world_size
from resilient_ckpt.local import BasicTensorAwareStateDict, LocalCheckpointManager
from resilient_ckpt.testing.faults import Action, Fault, Phase, flip_byte

from . import _common as c

WORLD = 2
CASE_S = 30.0
Case = tuple[str, type[BaseException], str, Callable[[int, str], Any]]


def _noop() -> None:
    pass


def _env(name: str, value: str, fn: Callable[[], Any]) -> Any:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        return fn()
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def _schedule(request: Any) -> None:
    AsyncCallsQueue(persistent=False).schedule_async_request(request)


def _closed_queue(rank: int, root: str) -> None:
    queue = AsyncCallsQueue(persistent=False)
    queue.close()
    queue.maybe_finalize_async_calls(blocking=True)


def _frozen(rank: int, root: str) -> None:
    AsyncRequest(_noop, (), []).freeze().add_finalize_fn(_noop)


def _manager(root: str, **kwargs: Any) -> LocalCheckpointManager:
    return LocalCheckpointManager(root, "sess", **kwargs)


def _tensors(rank: int) -> BasicTensorAwareStateDict:
    return BasicTensorAwareStateDict({"w": torch.ones(4) * rank})


def _local_save(rank: int, root: str, state: Any, iteration: int) -> None:
    _manager(os.path.join(root, "local")).save(state, iteration)


def _not_newer(rank: int, root: str) -> None:
    mgr = _manager(os.path.join(root, "older"))
    mgr.save(_tensors(rank), 5)
    mgr.save(_tensors(rank), 3)


def _dcp_plan(rank: int, root: str, state: Any, writer: Any = None) -> None:
    path = os.path.join(root, "dcp")
    save_state_dict_async_plan(state, writer or FileSystemWriterAsync(path))


def _a_file(root: str, content: bytes = b"x") -> str:
    path = os.path.join(root, "a_file")
    with open(path, "wb") as f:
        f.write(content)
    return path


def _cases() -> list[Case]:
    ok = {"w": torch.ones(2)}
    CE, IR = errors.ConfigurationError, errors.InvalidRequestError
    return [
        ("async_fn not callable", IR, "async_fn", lambda r, d: _schedule(AsyncRequest(42, (), []))),
        (
            "args not a tuple",
            IR,
            "async_fn_args",
            lambda r, d: _schedule(AsyncRequest(_noop, "ab", [])),
        ),
        (
            "kwargs not a dict",
            IR,
            "async_fn_kwargs",
            lambda r, d: _schedule(AsyncRequest(_noop, (), [], [])),
        ),  # type: ignore[arg-type]
        (
            "finalize fn not callable",
            IR,
            "finalize_fns",
            lambda r, d: _schedule(AsyncRequest(_noop, (), [1])),
        ),  # type: ignore[list-item]
        (
            "preload_fn not callable",
            IR,
            "preload_fn",
            lambda r, d: _schedule(AsyncRequest(_noop, (1, 2), [], preload_fn=3)),
        ),
        ("not a request", IR, "AsyncRequest", lambda r, d: _schedule("save please")),
        ("finalize fn added after scheduling", errors.FrozenRequestError, "frozen", _frozen),
        ("finalize on a closed queue", errors.QueueClosedError, "closed", _closed_queue),
        ("zero deadline", CE, "Timeouts.finalize", lambda r, d: Timeouts(finalize=0)),
        ("bool deadline", CE, "Timeouts.shutdown", lambda r, d: Timeouts(shutdown=True)),
        (
            "deadline env not a number",
            CE,
            "RESILIENT_CKPT_FINALIZE_TIMEOUT",
            lambda r, d: _env("RESILIENT_CKPT_FINALIZE_TIMEOUT", "soon", default_timeouts),
        ),
        (
            "LOCAL_WORLD_SIZE not an int",
            CE,
            "LOCAL_WORLD_SIZE",
            lambda r, d: _env("LOCAL_WORLD_SIZE", "two", local_world_size),
        ),
        (
            "worker io_priority",
            CE,
            "io_priority",
            lambda r, d: AsyncCallsQueue.warmup_persistent_caller(r, io_priority=9),
        ),
        (
            "writer thread_count 0",
            CE,
            "thread_count",
            lambda r, d: FileSystemWriterAsync(os.path.join(d, "w"), thread_count=0),
        ),
        (
            "writer path is a file",
            CE,
            "not a directory",
            lambda r, d: FileSystemWriterAsync(_a_file(d)),
        ),
        (
            "writer path unsupported URL",
            CE,
            "s3://",
            lambda r, d: FileSystemWriterAsync("s3://b/k"),
        ),
        (
            "writer path not a path",
            CE,
            "str or os.PathLike",
            lambda r, d: FileSystemWriterAsync(12),
        ),  # type: ignore[arg-type]
        (
            "DCP state not a dict (rank 1 only)",
            CE,
            "state_dict",
            lambda r, d: _dcp_plan(r, d, [1] if r == 1 else ok),
        ),
        ("DCP state int key", CE, "string keys", lambda r, d: _dcp_plan(r, d, {3: torch.ones(1)})),
        (
            "DCP writer of the wrong kind",
            CE,
            "storage_writer",
            lambda r, d: _dcp_plan(r, d, ok, writer=object()),
        ),
        (
            "local session_id with a slash",
            CE,
            "session_id",
            lambda r, d: LocalCheckpointManager(d, "a/b"),
        ),
        ("local keep_latest 0", CE, "keep_latest", lambda r, d: _manager(d, keep_latest=0)),
        (
            "local plain dict (rank 1 only)",
            CE,
            "TensorAwareStateDict",
            lambda r, d: _local_save(r, d, ok if r == 1 else _tensors(r), 1),
        ),
        (
            "local negative iteration (rank 1 only)",
            CE,
            "iteration",
            lambda r, d: _local_save(r, d, _tensors(r), -1 if r == 1 else 1),
        ),
        (
            "local iterations differ across ranks",
            CE,
            "different iterations",
            lambda r, d: _local_save(r, d, _tensors(r), 7 + r),
        ),
        ("local iteration not newer", CE, "not newer", _not_newer),
        (
            "torch async_save to a file object",
            CE,
            "file path",
            lambda r, d: TorchAsyncCheckpoint(False).async_save(ok, io.BytesIO()),
        ),
        (
            "torch async_save to a directory",
            CE,
            "is a directory",
            lambda r, d: TorchAsyncCheckpoint(False).async_save(ok, d),
        ),
        (
            "torch async_save to a missing directory",
            CE,
            "does not exist",
            lambda r, d: TorchAsyncCheckpoint(False).async_save(ok, os.path.join(d, "no", "x.pt")),
        ),
        (
            "verify a missing checkpoint",
            errors.CorruptCheckpointError,
            "metadata",
            lambda r, d: verify_checkpoint(os.path.join(d, "missing")),
        ),
        (
            "discover a missing root",
            CE,
            "does not exist",
            lambda r, d: discover(os.path.join(d, "missing")),
        ),
        (
            "fault kit: CORRUPT outside WRITE",
            CE,
            "Phase.WRITE",
            lambda r, d: Fault(Phase.OPEN_WRITE, Action.CORRUPT),
        ),
        (
            "fault kit: flip a byte of an empty file",
            CE,
            "empty",
            lambda r, d: flip_byte(_a_file(d, b"")),
        ),
    ]


def _job(rank: int, world: int, root: str) -> list[tuple[str, c.Trial]]:
    out = []
    for k, (name, expected, words, fn) in enumerate(_cases()):
        where = os.path.join(root, f"case{k}")
        os.makedirs(where, exist_ok=True)
        started = time.monotonic()
        if os.environ.get("BAD_DEBUG"):
            print(f"rank {rank} case {name}", flush=True)
        try:
            fn(rank, where)
            problem: str | None = "no error"
        except expected as exc:
            problem = None if words in str(exc) else f"the message does not say {words!r}: {exc}"
        except BaseException as exc:
            problem = f"{type(exc).__name__} instead of {expected.__name__}: {exc}"
        seconds = time.monotonic() - started
        if problem is None and not isinstance(expected, type(errors.CheckpointingException)):
            problem = "not from the errors.py hierarchy"
        if problem is None and not issubclass(expected, errors.CheckpointingException):
            problem = f"{expected.__name__} is not a CheckpointingException"
        if seconds > CASE_S:
            problem = f"took {seconds:.1f}s; {problem or ''}"
        out.append((name, c.Trial(problem is None, False, seconds, f"{name}: {problem}")))
    return out


def run(workdir: str) -> dict[str, list[c.Trial]]:
    count = len(_cases())
    started = time.monotonic()
    try:
        per_rank = c.launch(_job, WORLD, workdir, timeout=60 + 3 * count)
    except c.RankTimeout as exc:
        return {"bad_inputs": [c.hung(f"the job hung: {exc}", time.monotonic() - started)] * count}
    except c.RankFailure as exc:
        return {"bad_inputs": [c.failed(f"the job crashed: {exc}")] * count}
    trials = [c.merge([t for _, t in case]) for case in zip(*per_rank, strict=True)]
    return {"bad_inputs": trials}
