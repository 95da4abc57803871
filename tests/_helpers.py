"""Module-level functions for tests: the background worker must be able to import them."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch

from resilient_ckpt.async_ckpt._arena import ARENA_NAME


@contextlib.contextmanager
def torch_serial_layout() -> Iterator[None]:
    """Within: torch's ``FileSystemWriter`` lays a file out as it does without CUDA, tensors in
    plan order (our writer's layout, and NVRx's). Where CUDA is available and it writes with
    one thread, torch's loader orders a file's tensors by size instead: same checkpoint, other
    bytes."""
    with mock.patch("torch.cuda.is_available", return_value=False):
        yield


def write_tensors(path: str, state: Any) -> None:
    torch.save(state, path)


def write_after_marker(path: str, state: Any, marker: str, delay: float) -> None:
    """Announce our pid in ``marker``, wait ``delay`` seconds, then write ``state``."""
    with open(marker, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(delay)
    torch.save(state, path)


def append_line(path: str, text: str) -> None:
    with open(path, "a") as f:
        f.write(text + "\n")


def fail_with(message: str, state: Any = None) -> None:
    raise RuntimeError(message)


def fail_on_rank(rank_to_fail: int, rank: int, path: str, state: Any) -> None:
    if rank == rank_to_fail:
        raise RuntimeError(f"injected failure on rank {rank}")
    torch.save(state, path)


def return_none() -> None:
    return None


def identity_state(state: Any) -> Any:
    return state


def wait_for_file(path: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path) as f:
                text = f.read()
            if text:
                return text
        time.sleep(0.05)
    raise TimeoutError(f"{path} did not appear within {timeout}s")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def memfd_mappings() -> int:
    """How many distinct staging-arena memfds this process maps."""
    names = set()
    with open("/proc/self/maps") as f:
        for line in f:
            for token in line.split():
                if ARENA_NAME in token:
                    names.add(token)
    return len(names)


def rss_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def flip_byte(path: str) -> None:
    """Corrupt one byte in the middle of ``path`` (checksums must catch it)."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def result_then_linger(rank: int, world_size: int, seconds: float) -> int:
    """A rank function whose process outlives its result: a non-daemon thread keeps the
    interpreter from exiting (as a hung process-group teardown would)."""
    import threading

    threading.Thread(target=time.sleep, args=(seconds,), daemon=False).start()
    return rank * 10


def environment_and_alias(rank: int, world_size: int, name: str) -> tuple[str | None, bool]:
    """A rank's view of the variable ``name`` and whether the NVRx alias is installed."""
    import os

    from resilient_ckpt.compat import nvrx_alias_installed

    return os.environ.get(name), nvrx_alias_installed()
