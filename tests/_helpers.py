"""Module-level functions for tests: the background worker must be able to import them."""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch

from resilient_ckpt.async_ckpt._arena import ARENA_NAME
from resilient_ckpt.local import TensorAwareStateDict


@contextlib.contextmanager
def torch_serial_layout() -> Iterator[None]:
    """Within: torch's ``FileSystemWriter`` lays a file out as it does without CUDA, tensors in
    plan order (our writer's layout, and NVRx's). Where CUDA is available and it writes with
    one thread, torch's loader orders a file's tensors by size instead: same checkpoint, other
    bytes."""
    with mock.patch("torch.cuda.is_available", return_value=False):
        yield


@contextlib.contextmanager
def safe_globals(allowed: list[Any]) -> Iterator[None]:
    """``torch.serialization.safe_globals`` where torch has it (2.5 and later); on 2.4 the
    same by hand: ``add_safe_globals``, then the list as it was."""
    scoped = getattr(torch.serialization, "safe_globals", None)
    if scoped is not None:
        with scoped(allowed):
            yield
        return
    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals(allowed)
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


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


def memfd_mappings(pid: int | str = "self") -> int:
    """How many distinct staging-arena memfds the process ``pid`` (this one by default) maps."""
    names = set()
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            for token in line.split():
                if ARENA_NAME in token:
                    names.add(token)
    return len(names)


def shm_segments() -> set[str]:
    """The shared-memory segments in ``/dev/shm``: its files (``psm_*``, ``torch_*``,
    ``sem.*``), what a killed process can leave there. Directories are left out: the
    processes under test make none, while tests running beside them on other pytest workers
    make temporary directories there (``tempfile`` with ``dir="/dev/shm"``)."""
    if not os.path.isdir("/dev/shm"):
        return set()
    with os.scandir("/dev/shm") as entries:
        return {e.name for e in entries if not e.is_dir(follow_symlinks=False)}


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


class ListState(TensorAwareStateDict):
    """A custom state, as Megatron's: tensors in a list, an iteration beside them."""

    def __init__(self, tensors: list[torch.Tensor], iteration: int) -> None:
        self._tensors: list[torch.Tensor] | None = tensors
        self.iteration = iteration

    def pop_tensors(self) -> list[torch.Tensor]:
        tensors, self._tensors = self._tensors, None
        return tensors or []

    def insert_tensors(self, tensor_data: Any) -> None:
        self._tensors = list(tensor_data)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return list(self._tensors or [])

    @property
    def is_hollow(self) -> bool:
        return self._tensors is None

    def init_tensors(self) -> None:
        raise NotImplementedError

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        pass

    def restore_tensor_device(self, non_blocking: bool = False) -> None:
        pass


def flagged(t: torch.Tensor) -> torch.Tensor:
    t._is_param = True  # type: ignore[attr-defined]
    return t


def random_nested_state(rng: random.Random, depth: int = 0, signed_zero: bool = True) -> Any:
    """A random nest of dicts, OrderedDicts, lists and tuples over tensors and plain values
    (some parts only tensors, some mixed, some empty); ``signed_zero``: -0.0 among the leaves."""
    kind = rng.choice(["dict", "odict", "list", "tuple", "tensors"] if depth < 3 else ["leaf"])
    if kind == "leaf":
        leaves = [torch.rand(rng.randint(0, 3)), 1, 2.5, "s", None, b"b", True]
        return rng.choice(leaves + [-0.0] if signed_zero else leaves)
    if kind == "tensors":
        return {f"t{i}": torch.rand(2) for i in range(rng.randint(1, 4))}
    items = [random_nested_state(rng, depth + 1, signed_zero) for _ in range(rng.randint(0, 3))]
    if kind == "list":
        return items
    if kind == "tuple":
        return tuple(items)
    out: Any = dict if kind == "dict" else OrderedDict
    return out((f"k{i}", item) for i, item in enumerate(items))


def skeleton(obj: Any) -> Any:
    """``obj``'s containers with their types, and every plain leaf with its type and exact
    value (``repr``: -0.0 is not 0.0); tensors are compared by ``diff``."""
    if isinstance(obj, dict):
        return type(obj), [(k, skeleton(v)) for k, v in obj.items()]
    if isinstance(obj, (list, tuple)):
        return type(obj), [skeleton(v) for v in obj]
    return "tensor" if isinstance(obj, torch.Tensor) else (type(obj), repr(obj))


# Changes of a ListState's tensors that change its records: (what, the change), in turn.
LIST_STATE_CHANGES: list[tuple[str, Callable[[list[torch.Tensor]], None]]] = [
    ("shape", lambda ts: ts.__setitem__(0, torch.rand(5))),
    ("dtype", lambda ts: ts.__setitem__(1, ts[1].double())),
    ("requires_grad", lambda ts: ts[2].requires_grad_()),
    ("parameter", lambda ts: ts.__setitem__(3, torch.nn.Parameter(ts[3].detach()))),
    ("_is_param flag", lambda ts: ts.__setitem__(4, flagged(ts[4].detach().clone()))),
    ("one more", lambda ts: ts.append(torch.rand(2, 2))),
    ("one less", lambda ts: ts.pop()),
]


class RunsCode:
    """Pickles as a call of ``os.mkdir(marker)``: unpickling it freely creates the marker
    directory, so a test of a reader that must not run a file's code asserts it is absent."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.mkdir, (self.marker,))


def fsdp2_model(world: int, outputs: int = 8) -> torch.nn.Module:
    """A small FSDP2 model over a CPU mesh of ``world`` ranks (the same initial weights on
    every rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, outputs)
    )
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
