"""Write and read throughput of a 2-rank async save to a local S3 server, against boto3.

One run starts moto's S3 server on loopback (the same server the object-store tests use),
creates a bucket and writes a multi-storage-client profile for it. Two gloo ranks then, per
repetition and interleaved so load noise hits both alike:

* **ours, write**: ``FileSystemWriterAsync(msc://...)`` planned and scheduled on the
  persistent async queue, finalized (blocking): the time from the call to the committed
  checkpoint (metadata object uploaded), slowest rank; the trainer's stall is reported too.
* **ours, read**: ``dcp.load`` with ``CachedMetadataFileSystemReader`` into pre-allocated
  tensors (checked bit-exact once, untimed).
* **boto3, write / read**: each rank uploads its shard's same bytes as one object with
  ``upload_fileobj`` (boto3's default multipart transfer: 8 MiB parts, 10 threads) and
  downloads it with ``download_fileobj``: what a hand-written S3 checkpoint would cost.

Throughput is the bytes of both ranks over the slowest rank's time, median of ``--reps``
repetitions after a warm-up. The server, both clients and both ranks share this machine's
CPUs, so the figures are indicative, and the ratio is what to read.

    python benchmarks/object_store.py --size 64M --reps 3
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import human, make_state, parse_size, print_table
from resilient_ckpt.async_ckpt.cached_metadata_filesystem_reader import (
    CachedMetadataFileSystemReader,
)
from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from resilient_ckpt.async_ckpt.state_dict_saver import (
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from resilient_ckpt.cli.bench._s3_nodes import ACCESS_KEY, REGION, SECRET_KEY, write_profile
from resilient_ckpt.storage import get_backend
from resilient_ckpt.testing.launcher import launch

PROFILE = "bench-s3"


@dataclass(frozen=True)
class Config:
    nbytes: int  # both ranks together
    reps: int
    threads: int
    endpoint: str
    bucket: str


def _s3_client(cfg: Config) -> Any:
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=cfg.endpoint,
        region_name=REGION,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
    )


class _Methods:
    """One save and one load per method; each returns this rank's seconds."""

    def __init__(self, rank: int, cfg: Config) -> None:
        self.rank, self.cfg = rank, cfg
        state = make_state(cfg.nbytes // 2, tensor_bytes=8 << 20)
        self.state = {f"rank{rank}.{k}": v for k, v in state.items()}
        self.raw = b"".join(t.numpy().tobytes() for t in self.state.values())
        self.queue = AsyncCallsQueue()
        self.s3 = _s3_client(cfg)

    def ours(self, rep: int) -> dict[str, float]:
        path = f"msc://{PROFILE}/ours{rep}"
        dist.barrier()
        started = time.perf_counter()
        writer = FileSystemWriterAsync(path, thread_count=self.cfg.threads)
        plan_ret = save_state_dict_async_plan(self.state, writer)
        save_fn, preload_fn, args = writer.get_save_function_and_args()

        def finalize() -> None:
            save_state_dict_async_finalize(*plan_ret)

        self.queue.schedule_async_request(
            AsyncRequest(save_fn, args, [finalize], preload_fn=preload_fn)
        )
        stall = time.perf_counter() - started
        self.queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
        write = time.perf_counter() - started

        loaded = {k: torch.empty_like(v) for k, v in self.state.items()}
        dist.barrier()
        started = time.perf_counter()
        dcp.load(loaded, storage_reader=CachedMetadataFileSystemReader(path, thread_count=2))
        read = time.perf_counter() - started
        if rep == 0 and not all(torch.equal(loaded[k], v) for k, v in self.state.items()):
            raise RuntimeError(f"rank {self.rank}: {path} did not load back bit-exact")
        dist.barrier()
        if self.rank == 0:
            backend = get_backend(path)
            backend.delete(path, recursive=True)
        return {"stall": stall, "write": write, "read": read}

    def boto3(self, rep: int) -> dict[str, float]:
        key = f"boto3-{rep}/rank{self.rank}.bin"
        dist.barrier()
        started = time.perf_counter()
        self.s3.upload_fileobj(io.BytesIO(self.raw), self.cfg.bucket, key)
        write = time.perf_counter() - started
        dist.barrier()
        started = time.perf_counter()
        out = io.BytesIO()
        self.s3.download_fileobj(self.cfg.bucket, key, out)
        read = time.perf_counter() - started
        if rep == 0 and out.getvalue() != self.raw:
            raise RuntimeError(f"rank {self.rank}: s3://{self.cfg.bucket}/{key} differs")
        self.s3.delete_object(Bucket=self.cfg.bucket, Key=key)
        return {"write": write, "read": read}


def _rank(rank: int, world: int, cfg: Config) -> dict[str, dict[str, list[float]]]:
    warnings.filterwarnings("ignore")
    methods = _Methods(rank, cfg)
    out: dict[str, dict[str, list[float]]] = {"ours": {}, "boto3": {}}
    try:
        for rep in range(cfg.reps + 1):  # repetition 0 warms up (worker start, clients)
            for name in ("ours", "boto3"):
                for key, value in getattr(methods, name)(rep).items():
                    if rep:
                        out[name].setdefault(key, []).append(value)
    finally:
        methods.queue.close()
    return out


def _slowest(per_rank: list[dict], method: str, key: str) -> float:
    """Median over repetitions of the slowest rank's time."""
    reps = zip(*(r[method][key] for r in per_rank), strict=True)
    return statistics.median(max(times) for times in reps)


def _report(cfg: Config, per_rank: list[dict]) -> None:
    rows = []
    for phase in ("write", "read"):
        ours, ref = _slowest(per_rank, "ours", phase), _slowest(per_rank, "boto3", phase)
        rows.append(
            [
                phase,
                f"{ours:.3f} s",
                f"{cfg.nbytes / ours / 1e6:.0f} MB/s",
                f"{ref:.3f} s",
                f"{cfg.nbytes / ref / 1e6:.0f} MB/s",
                f"{ref / ours:.2f}",
            ]
        )
    stall = _slowest(per_rank, "ours", "stall")
    rows.append(["trainer stall (ours)", f"{stall:.3f} s", "", "", "", ""])
    print_table(
        f"2 ranks, {human(cfg.nbytes)} in all, {cfg.threads} writer threads per rank, "
        f"median of {cfg.reps} (slowest rank); throughput ratio = boto3 time / ours time",
        ["phase", "ours", "ours MB/s", "boto3", "boto3 MB/s", "ours/boto3 throughput"],
        rows,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="64M", help="bytes of both ranks together")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="writer threads per rank")
    args = parser.parse_args(argv)

    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint, bucket = f"http://{host}:{port}", f"bench-{uuid.uuid4().hex[:8]}"
        cfg = Config(parse_size(args.size), args.reps, args.threads, endpoint, bucket)
        _s3_client(cfg).create_bucket(Bucket=cfg.bucket)
        with tempfile.TemporaryDirectory() as tmp:
            config_path = os.path.join(tmp, "msc_config.yaml")
            write_profile(config_path, cfg.endpoint, cfg.bucket, PROFILE)
            os.environ["MSC_CONFIG"] = config_path  # the spawned ranks inherit it
            per_rank = launch(_rank, 2, cfg, timeout=1800)
        _report(cfg, per_rank)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
