"""Shared pieces of the NVRx async compatibility tests (picklable: workers import them)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import DefaultSavePlanner

from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync


def wait_for_file(path: str | Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not Path(path).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {path}")
        time.sleep(0.01)


class GatedOpen:
    """An ``open_file`` hook that signals it was called, then waits for a release file:
    lets a test look at the trainer while the background write is blocked."""

    def __init__(self, started: str | Path, release: str | Path) -> None:
        self.started = str(started)
        self.release = str(release)

    def __call__(self, path: str, mode: str = "rb", **kwargs: Any) -> IO[Any]:
        Path(self.started).touch()
        wait_for_file(self.release)
        return open(path, mode, **kwargs)


class RecordingOpen:
    """An ``open_file`` hook that appends each path it opens to a log file."""

    def __init__(self, log: str | Path) -> None:
        self.log = str(log)

    def __call__(self, path: str, mode: str = "rb", **kwargs: Any) -> IO[Any]:
        with open(self.log, "a") as f:
            f.write(f"{path} {mode}\n")
        return open(path, mode, **kwargs)


def failing_open(path: str, mode: str = "rb", **kwargs: Any) -> IO[Any]:
    raise OSError("worker critical failure during open()")


def prepared_writer(
    checkpoint_dir: str | Path, state: dict[str, Any], **writer_kwargs: Any
) -> tuple[FileSystemWriterAsync, Any, Any]:
    """A writer prepared for one save of ``state`` on a single rank, without a process
    group: ``(writer, planner, global metadata)``."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    writer = FileSystemWriterAsync(checkpoint_dir, **writer_kwargs)
    writer.set_up_storage_writer(True)
    local_plan = writer.prepare_local_plan(planner.create_local_plan())
    plans, metadata = planner.create_global_plan([local_plan])
    plans = writer.prepare_global_plan(plans)
    writer.prepare_write_data(planner.finish_plan(plans[0]), planner)
    return writer, planner, metadata


def small_state() -> dict[str, Any]:
    return {"value": torch.arange(8), "step": 3}


def write_marker(path: str, *args: Any, label: str = "") -> None:
    """An async_fn: records that it ran, with what (for the worker-loop tests)."""
    with open(path, "w") as f:
        f.write(f"{args!r} {label}")


def failing_preload() -> Any:
    raise RuntimeError("preload failed")


def failing_write(*args: Any) -> None:
    raise RuntimeError("write failed")
