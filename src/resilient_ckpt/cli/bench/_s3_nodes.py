"""A durable tier for scale benchmarks: an S3 API server on loopback, reached by each
simulated node through its own bandwidth-limited proxy.

:class:`ThrottledObjectStore` starts moto's S3 server (the server the object-store tests
use) on ``127.0.0.1``, creates a bucket, and for each simulated node a
:class:`~resilient_ckpt.testing.fault_proxy.FaultInjectingProxy` with its own
:class:`~resilient_ckpt.testing.throttle.Throttle`, and a multi-storage-client config file
whose profile points at that node's proxy. A rank sets ``MSC_CONFIG`` to its node's file
before it touches the store (:meth:`ThrottledObjectStore.use_node`), so every rank uses the
same ``msc://`` URLs and the ranks of one node share one link. The proxies log every request,
which :func:`storage_ops` turns into object operations per checkpoint.
"""

from __future__ import annotations

import logging
import os
import re
import urllib.parse
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ...errors import ConfigurationError
from ...testing.fault_proxy import FaultInjectingProxy
from ...testing.throttle import Throttle

REGION = "us-east-1"
ACCESS_KEY = "bench-access-key"
SECRET_KEY = "bench-secret-key"
PROFILE = "scale-bench"


def require_object_store_packages() -> None:
    """A clear error when moto's server or multi-storage-client is missing."""
    import importlib.util

    missing = [
        name
        for name, module in (
            ("moto[server]", "moto.server"),
            ("multi-storage-client[boto3]", "multistorageclient"),
            ("boto3", "boto3"),
            ("pyyaml", "yaml"),
        )
        if importlib.util.find_spec(module.split(".")[0]) is None
    ]
    if missing:
        raise ConfigurationError(
            "this benchmark runs an S3 API server on loopback and needs "
            f"{', '.join(missing)}: pip install 'resilient-ckpt[msc]' 'moto[server]' pyyaml"
        )


def describe_limit(rate: float, ranks_per_node: int) -> str:
    """The durable tier and its limit, and why the limit is what it is, as the benchmarks that
    use this store print it."""
    return (
        f"durable tier: moto's S3 API server on loopback, each simulated node of "
        f"{ranks_per_node} ranks behind its own proxy limited to {rate / 1e6:g} MB/s (uploads "
        "and downloads together). Why: a restore on a cluster is limited by each node's share "
        "of the shared file system or object store (typically 0.2-2 GB/s per node); the state "
        "here is MiBs per rank instead of GiBs, so the limit is scaled down with it, far enough "
        "below what the loopback server and this machine's cores can serve that the links, not "
        "the CPUs, set the restore time. Peer traffic (gloo) is not limited: on a cluster it "
        "takes the interconnect."
    )


@dataclass(frozen=True)
class Nodes:
    """What a rank needs to reach the store: its node's MSC config file."""

    configs: tuple[str, ...]
    ranks_per_node: int

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def use_node(self, rank: int) -> None:
        """Point this process (and the workers it starts later) at its node's proxy."""
        os.environ["MSC_CONFIG"] = self.configs[self.node_of(rank)]


@dataclass
class ThrottledObjectStore:
    """moto's S3 server and one throttled proxy per simulated node (see the module doc)."""

    directory: str
    rate: float | None  # bytes/s per node; None: no limit
    server: Any = None
    proxies: list[FaultInjectingProxy] = field(default_factory=list)
    bucket: str = ""

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()

    def open_nodes(self, nodes: int, ranks_per_node: int) -> Nodes:
        """A fresh bucket and ``nodes`` proxies (closing those of an earlier call)."""
        self.close_nodes()
        host, port = self.server.get_host_and_port()
        self.bucket = f"scale-{uuid.uuid4().hex[:12]}"
        self.client(f"http://{host}:{port}").create_bucket(Bucket=self.bucket)
        configs = []
        for node in range(nodes):
            throttle = Throttle(self.rate) if self.rate else None
            proxy = FaultInjectingProxy(host, port, throttle=throttle)
            self.proxies.append(proxy)
            path = os.path.join(self.directory, f"msc_node{node}.yaml")
            write_profile(path, proxy.endpoint, self.bucket)
            configs.append(path)
        return Nodes(tuple(configs), ranks_per_node)

    def requests(self) -> list[list[tuple[str, str, str]]]:
        """Every request each node's proxy forwarded so far, by node."""
        return [proxy.requests() for proxy in self.proxies]

    def sizes(self, prefix: str) -> dict[str, int]:
        """The size of every object under ``prefix``, read from the server directly (not
        through a node's proxy, so it is neither throttled nor counted)."""
        host, port = self.server.get_host_and_port()
        s3 = self.client(f"http://{host}:{port}")
        found: dict[str, int] = {}
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        for page in pages:
            found.update({o["Key"]: int(o["Size"]) for o in page.get("Contents", [])})
        return found

    def close_nodes(self) -> None:
        for proxy in self.proxies:
            proxy.close()
        self.proxies.clear()
        if self.bucket:
            self._empty_bucket()
            self.bucket = ""

    def stop(self) -> None:
        self.close_nodes()
        if self.server is not None:
            self.server.stop()
            self.server = None

    @staticmethod
    def client(endpoint: str) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name=REGION,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
        )

    def _empty_bucket(self) -> None:
        """Free the server's memory between world sizes (it keeps objects in memory)."""
        host, port = self.server.get_host_and_port()
        s3 = self.client(f"http://{host}:{port}")
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                s3.delete_objects(Bucket=self.bucket, Delete={"Objects": keys})
        s3.delete_bucket(Bucket=self.bucket)


def write_profile(path: str, endpoint: str, bucket: str, profile_name: str = PROFILE) -> None:
    """An MSC config file at ``path`` with one profile for ``bucket`` on the S3 API server at
    ``endpoint`` (the benchmarks' region and credentials)."""
    import yaml

    profile = {
        "storage_provider": {
            "type": "s3",
            "options": {"base_path": bucket, "endpoint_url": endpoint, "region_name": REGION},
        },
        "credentials_provider": {
            "type": "S3Credentials",
            "options": {"access_key": ACCESS_KEY, "secret_key": SECRET_KEY},
        },
    }
    with open(path, "w") as f:
        yaml.safe_dump({"profiles": {profile_name: profile}}, f)


def _operation(method: str, path: str) -> tuple[str, str]:
    """``(operation, key or prefix)`` of one S3 request as the proxy logged it."""
    parsed = urllib.parse.urlsplit(path)
    _, _, key = parsed.path.lstrip("/").partition("/")
    key = urllib.parse.unquote(key)
    query = urllib.parse.parse_qs(parsed.query, keep_blank_values=True)
    if not key:
        prefix = query.get("prefix", [""])[0]
        return ("LIST" if method == "GET" else f"{method} bucket"), prefix
    if method == "POST":
        return ("multipart " + ("start" if "uploads" in query else "complete")), key
    if method == "PUT" and "partNumber" in query:
        return "PUT part", key
    return method, key


def storage_ops(requests: list[tuple[str, str, str]], pattern: str) -> dict[str, Counter[str]]:
    """Object operations per checkpoint: requests whose key (or listed prefix) matches the
    regular expression ``pattern`` are counted under its first group, by operation."""
    matcher = re.compile(pattern)
    out: dict[str, Counter[str]] = {}
    for method, path, _outcome in requests:
        operation, key = _operation(method, path)
        found = matcher.search(key)
        if found:
            out.setdefault(found.group(1), Counter())[operation] += 1
    return out
