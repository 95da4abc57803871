"""Scale benchmark: read-once restores from a bandwidth-limited object store, and the
coordination a steady-state save costs, at W = 2, 4, 8 (16 with ``--with-16``) ranks.

Durable tier: moto's S3 API server on loopback, reached by each simulated node (``--per-node``
ranks) through its own proxy limited to ``--node-rate`` bytes per second, shared by the
node's ranks (:mod:`._s3_nodes`). On a cluster a restore is limited by each node's share of
the storage service, not by the storage's memory; the proxy puts that limit back. Peer
traffic (the process group) is not limited: on a cluster it takes the interconnect.

For each W, one launch of W gloo ranks (spawned) measures:

* **Restore**: two states (``--states``) are saved through the async queue and our writer:
  ``pure DP``, every rank holding the same tensors, and ``half sharded``, half of each rank's
  bytes replicated and half a DTensor sharded over all ranks. Each is restored with ``dcp.load``
  into a blank state, alternately with our reader (read-once, the default) and with torch's
  ``FileSystemReader`` over the object store (multi-storage-client's
  ``MultiStorageFileSystemReader``, a ``FileSystemReader`` with MSC's file system: torch has
  no public object-store reader of its own), ``--repeats`` times, job time (a barrier before
  and after), checked bit-exact. Bytes read from storage: ours from ``bytes_read_by_rank``,
  torch's counted at its file system (each object it opens is downloaded whole), both over
  the checkpoint's data bytes.
* **Census** (:mod:`._collectives`): every collective of each steady-state save (the second
  and later of ``--saves``, after ``warmup_async_save``, through ``AsyncCallsQueue``,
  ``FileSystemWriterAsync`` and ``save_state_dict_async_plan`` / ``_finalize``, polled as a
  training loop polls) and of one restore with each reader, by kind, group and payload; and
  the object operations of each save, counted at the nodes' proxies.

Then it prints the restore table, a census table per W, and the projection of a steady save's
coordination time to 1,024 and 16,384 ranks with an alpha-beta model (:mod:`._scale_model`),
saying which terms grow with W.

Run by ``resilient-ckpt bench --only restore_scale [--quick] [-- --with-16]``; needs
``moto[server]`` and the ``msc`` extra.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ...errors import ConfigurationError
from ...testing import launch
from .._help import plain
from . import _scale_report
from ._collectives import CollectiveCensus
from ._s3_nodes import PROFILE, Nodes, ThrottledObjectStore, require_object_store_packages
from .common import parse_size

STATE_NAMES = {"dp": "pure DP", "half": "half sharded"}
# The census state: its collectives do not depend on its bytes, only on its structure.
CENSUS_TENSORS = 16
CENSUS_TENSOR_BYTES = 4 << 10
# The census polls the finalize as a training loop does, once a step.
POLL_INTERVAL = 0.05


@dataclass(frozen=True)
class Config:
    nodes: Nodes
    prefix: str  # msc:// URL under which this launch writes
    size: int  # state bytes per rank
    states: tuple[str, ...]
    tensors: int
    repeats: int
    saves: int


# -- the states --------------------------------------------------------------------------------


def _mesh(world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _tensors(prefix: str, nbytes: int, count: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    per = max(1, nbytes // count // 4)
    return {f"{prefix}.layer{i:03d}": torch.rand(per, generator=g) for i in range(count)}


def make_state(kind: str, rank: int, mesh: Any, nbytes: int, tensors: int) -> dict[str, Any]:
    """``pure DP``: the same tensors on every rank. ``half sharded``: half the bytes so,
    half a DTensor sharded over every rank (this rank's shard is its own)."""
    from ..._torch_compat import DTensor, Shard

    if kind == "pure DP":
        return dict(_tensors("dp", nbytes, tensors, seed=1234))
    replicated = _tensors("replicated", nbytes // 2, max(1, tensors // 2), seed=1234)
    local = _tensors("sharded", nbytes // 2, max(1, tensors // 2), seed=rank)
    sharded = {
        k: DTensor.from_local(v, mesh, [Shard(0)], run_check=False) for k, v in local.items()
    }
    return {**replicated, **sharded}


def _blank(state: dict[str, Any]) -> dict[str, Any]:
    from ..._torch_compat import DTensor

    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, DTensor):
            zeros = torch.zeros_like(value.to_local())
            out[key] = DTensor.from_local(zeros, value.device_mesh, value.placements)
        else:
            out[key] = torch.zeros_like(value)
    return out


def _check_equal(loaded: dict[str, Any], state: dict[str, Any], what: str) -> None:
    from ..._torch_compat import DTensor

    for key, value in state.items():
        got = loaded[key]
        if isinstance(value, DTensor):
            value, got = value.to_local(), got.to_local()
        if not torch.equal(got, value):
            raise RuntimeError(f"rank {dist.get_rank()}: {what} restored {key} wrong")


# -- saving ------------------------------------------------------------------------------------


def _schedule(queue: Any, state: dict[str, Any], path: str, cache: Any = None) -> None:
    from ...async_ckpt.core import AsyncRequest
    from ...async_ckpt.filesystem_async import FileSystemWriterAsync
    from ...async_ckpt.state_dict_saver import (
        save_state_dict_async_finalize,
        save_state_dict_async_plan,
    )

    writer = FileSystemWriterAsync(path)
    ret = save_state_dict_async_plan(
        state, writer, enable_cache=cache is not None, metadata_cache=cache
    )
    save_fn, preload_fn, args = writer.get_save_function_and_args()
    finalize = functools.partial(save_state_dict_async_finalize, *ret)
    queue.schedule_async_request(AsyncRequest(save_fn, args, [finalize], preload_fn=preload_fn))


def _census_saves(cfg: Config, rank: int, mesh: Any, queue: Any, census: Any) -> list[int]:
    """``cfg.saves`` saves, each recorded as phases ``save N plan`` and ``save N call K``
    (each finalize call; the last one committed). Returns the finalize calls per save."""
    from ...async_ckpt.state_dict_saver import CheckpointMetadataCache
    from ...async_ckpt.warmup import warmup_async_save

    state = make_state("half sharded", rank, mesh, CENSUS_TENSORS * CENSUS_TENSOR_BYTES, 16)
    cache = CheckpointMetadataCache()
    warmup_async_save(state, queue, metadata_cache=cache)
    calls = []
    for n in range(1, cfg.saves + 1):
        dist.barrier()
        with census.phase(f"save {n} plan"):
            _schedule(queue, state, f"{cfg.prefix}/census/save{n}", cache)
        k = 0
        while True:
            k += 1
            with census.phase(f"save {n} call {k}"):
                done = queue.maybe_finalize_async_calls(blocking=False)
            if done:
                break
            time.sleep(POLL_INTERVAL)  # a training step
        calls.append(k)
    return calls


# -- restoring ---------------------------------------------------------------------------------


@functools.cache
def _counting_file_system() -> type:
    """MSC's torch file system, counting the data bytes of each object it opens for reading
    (it downloads an object whole on open: ``prefetch_file=True``)."""
    from multistorageclient.contrib.torch.filesystem import MultiStorageFileSystem

    class CountingFileSystem(MultiStorageFileSystem):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.bytes_read = 0

        def create_stream(self, path: Any, mode: str) -> Any:
            return _counted(super().create_stream(path, mode), self, str(path), mode)

    return CountingFileSystem


class _counted:
    """A stream context that adds the stream's length to ``fs.bytes_read`` on entry."""

    def __init__(self, inner: Any, fs: Any, path: str, mode: str) -> None:
        self.inner, self.fs, self.path, self.mode = inner, fs, path, mode

    def __enter__(self) -> Any:
        stream = self.inner.__enter__()
        if "r" in self.mode and not self.path.endswith(".metadata"):
            self.fs.bytes_read += stream.seek(0, os.SEEK_END)
            stream.seek(0)
        return stream

    def __exit__(self, *exc: Any) -> Any:
        return self.inner.__exit__(*exc)


def _torch_reader(path: str) -> Any:
    """torch's ``FileSystemReader`` over the object store (see the module docstring)."""
    from multistorageclient.contrib.torch.filesystem import MultiStorageFileSystemReader

    reader = MultiStorageFileSystemReader(path)  # one thread: torch's read_data as is
    reader.fs = _counting_file_system()()
    return reader


def _our_reader(path: str) -> Any:
    from ...async_ckpt.cached_metadata_filesystem_reader import CachedMetadataFileSystemReader

    # A restart reads the metadata once: no metadata cache from an earlier load.
    return CachedMetadataFileSystemReader(path, cache_metadata=False)


def _bytes_read(name: str, reader: Any) -> list[int]:
    """Every rank's data bytes read from storage in ``reader``'s load (collective)."""
    from ...async_ckpt.cached_metadata_filesystem_reader import bytes_read_by_rank

    if name == "read-once":
        return bytes_read_by_rank(reader)
    counts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(counts, int(reader.fs.bytes_read))
    return [int(c) for c in counts]


READERS: dict[str, Callable[[str], Any]] = {"torch reader": _torch_reader, "read-once": _our_reader}


def _timed_load(state: dict[str, Any], reader: Any) -> tuple[float, dict[str, Any]]:
    into = _blank(state)
    dist.barrier()
    started = time.perf_counter()
    dcp.load(into, storage_reader=reader)
    dist.barrier()
    return time.perf_counter() - started, into


def _restores(cfg: Config, rank: int, mesh: Any, queue: Any, census: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in cfg.states:
        state = make_state(kind, rank, mesh, cfg.size, cfg.tensors)
        path = f"{cfg.prefix}/restore/{kind.replace(' ', '_')}"
        _schedule(queue, state, path)
        queue.maybe_finalize_async_calls(blocking=True)
        figures: dict[str, Any] = {name: {"seconds": [], "bytes": None} for name in READERS}
        for repeat in range(cfg.repeats):
            order = list(READERS) if repeat % 2 == 0 else list(READERS)[::-1]
            for name in order:
                reader = READERS[name](path)
                if repeat == 0:  # the census of one restore per reader, checked bit-exact
                    with census.phase(f"restore {kind}: {name}"):
                        seconds, into = _timed_load(state, reader)
                    _check_equal(into, state, name)
                    figures[name]["bytes"] = _bytes_read(name, reader)
                else:
                    seconds, _ = _timed_load(state, reader)
                figures[name]["seconds"].append(seconds)
        out[kind] = figures
    return out


# -- one launch --------------------------------------------------------------------------------


def _rank(rank: int, world: int, cfg: Config) -> dict[str, Any]:
    from ...async_ckpt.core import AsyncCallsQueue

    cfg.nodes.use_node(rank)
    mesh = _mesh(world)
    queue = AsyncCallsQueue()
    census = CollectiveCensus()
    try:
        with census:
            polls = _census_saves(cfg, rank, mesh, queue, census)
            restores = _restores(cfg, rank, mesh, queue, census)
    finally:
        queue.close()
    calls = {phase: [asdict(c) for c in found] for phase, found in census.calls.items()}
    return {"calls": calls, "finalize_calls": polls, "restores": restores}


def run_world(store: ThrottledObjectStore, args: argparse.Namespace, world: int) -> dict[str, Any]:
    """One launch of ``world`` ranks; its results, the object operations and sizes."""
    per_node = min(args.per_node, world)
    nodes = store.open_nodes(world // per_node, per_node)
    key = f"w{world}"
    cfg = Config(
        nodes,
        f"msc://{PROFILE}/{key}",
        args.size,
        args.states,
        args.tensors,
        args.repeats,
        args.saves,
    )
    started = time.perf_counter()
    try:
        ranks = launch(
            _rank,
            world,
            cfg,
            timeout=args.timeout,
            start_method="spawn",
            env={"OMP_NUM_THREADS": "1"},
        )
        sizes = store.sizes(key + "/")
        requests = store.requests()
    finally:
        store.close_nodes()
    return {
        "world": world,
        "nodes": len(nodes.configs),
        "per_node": per_node,
        "seconds": time.perf_counter() - started,
        "ranks": ranks,
        "sizes": sizes,
        "requests": requests,
        "key": key,
    }


# -- the command -------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="restore_scale", description=plain((__doc__ or "").splitlines()[0])
    )
    p.add_argument("--ranks", default="2,4,8", help="world sizes, comma-separated")
    p.add_argument("--with-16", action="store_true", help="also W=16 (needs the memory)")
    p.add_argument("--per-node", type=int, default=2, help="ranks per simulated node")
    p.add_argument(
        "--node-rate",
        type=parse_size,
        default=16 * 10**6,
        help="bytes/s of each simulated node's link to the store (K/M/G are binary)",
    )
    p.add_argument("--size", type=parse_size, default=32 << 20, help="state bytes per rank")
    p.add_argument("--tensors", type=int, default=32, help="tensors per state")
    p.add_argument("--repeats", type=int, default=3, help="restores per reader and state")
    p.add_argument("--saves", type=int, default=5, help="census saves (the first warms up)")
    p.add_argument("--alpha-us", type=float, default=20.0, help="model: latency per hop (us)")
    p.add_argument("--link-gbs", type=float, default=5.0, help="model: 1/beta (GB/s)")
    p.add_argument(
        "--storage-gbs",
        type=float,
        default=1.0,
        help="model: a node's share of the storage on a cluster (GB/s), for the .metadata",
    )
    p.add_argument(
        "--states",
        default=",".join(STATE_NAMES),
        help=f"states to restore, comma-separated: {', '.join(STATE_NAMES)}",
    )
    p.add_argument("--quick", action="store_true", help="small state, fewer repeats")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    p.add_argument("--dir", default=None, help="where the MSC config files go")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    return p


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    if args.quick:
        given = set(argv or ())
        if "--size" not in given:
            args.size = 8 << 20
        if "--repeats" not in given:
            args.repeats = 2
        if "--saves" not in given:
            args.saves = 3
    try:
        worlds = [int(w) for w in str(args.ranks).split(",") if w.strip()]
    except ValueError:
        p.error(f"--ranks must be comma-separated integers, got {args.ranks!r}")
    if args.with_16 and 16 not in worlds:
        worlds.append(16)
    if not worlds or any(w < 2 for w in worlds):
        p.error(f"--ranks: every world size must be >= 2, got {worlds}")
    if args.per_node < 1 or any(w % min(args.per_node, w) for w in worlds):
        p.error(f"--per-node {args.per_node} must divide every world size {worlds}")
    if args.repeats < 1 or args.saves < 2 or args.tensors < 2 or args.node_rate <= 0:
        p.error("--repeats >= 1, --saves >= 2, --tensors >= 2 and --node-rate > 0 are needed")
    states = [s.strip() for s in str(args.states).split(",") if s.strip()]
    unknown = [s for s in states if s not in STATE_NAMES]
    if not states or unknown:
        p.error(f"--states: choose from {', '.join(STATE_NAMES)}, got {args.states!r}")
    args.states = tuple(STATE_NAMES[s] for s in dict.fromkeys(states))
    args.worlds = sorted(worlds)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    try:
        require_object_store_packages()
    except ConfigurationError as exc:
        print(f"restore_scale: {exc}", file=sys.stderr)
        return 2
    directory = tempfile.mkdtemp(prefix="rc_restore_scale_", dir=args.dir)
    store = ThrottledObjectStore(directory, float(args.node_rate))
    runs = []
    try:
        store.start()
        for world in args.worlds:
            runs.append(run_world(store, args, world))
    finally:
        store.stop()
        shutil.rmtree(directory, ignore_errors=True)
    document = _scale_report.report(args, runs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(document, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
