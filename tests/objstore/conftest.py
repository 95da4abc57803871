"""Fixtures: a real S3 API server (moto) on loopback, and MSC profiles that point at it.

``msc_store`` is parametrised over two MSC providers, so every test that takes it runs
twice: ``s3`` (moto's S3 server, reached through a :class:`FaultInjectingProxy` that tests
may arm) and ``posix`` (MSC's local file-system provider). Each test gets a fresh bucket or
directory, an MSC config file written for it, and ``MSC_CONFIG`` pointing at that file;
spawned ranks and workers inherit the environment. Retry backoff is shortened so injected
faults cost milliseconds; the client libraries' own retries are off in these profiles, so
the library's retry policy alone decides (and tests can count tries exactly). Profile names
are unique per test because MSC caches its clients by profile name, process-wide.
``s3_and_posix_stores`` gives both stores at once (one config, two profiles) to
multi-process tests, so that each scenario pays for one launch of ranks, not two.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("multistorageclient", reason="needs the msc extra (multi-storage-client)")
pytest.importorskip("moto.server", reason="needs moto[server] (the dev extra)")

from resilient_ckpt.testing.fault_proxy import FaultInjectingProxy

REGION = "us-east-1"
ACCESS_KEY = "testing-access-key"
SECRET_KEY = "testing-secret-key"


@dataclass
class Store:
    """One test's object store: where it is, and raw access that bypasses MSC."""

    kind: str
    profile: str
    config_path: str
    prefix: str
    proxy: FaultInjectingProxy | None = None
    s3: Any = None
    bucket: str | None = None
    root: str | None = None

    def url(self, *parts: str) -> str:
        return "/".join([f"msc://{self.profile}/{self.prefix}", *parts])

    def keys(self, sub: str = "") -> list[str]:
        """Every object below ``prefix/sub``, relative to ``prefix``, read without MSC."""
        base = f"{self.prefix}/{sub}".rstrip("/")
        if self.kind == "s3":
            paginator = self.s3.get_paginator("list_objects_v2")
            keys = []
            for page in paginator.paginate(Bucket=self.bucket, Prefix=base + "/"):
                keys += [o["Key"][len(self.prefix) + 1 :] for o in page.get("Contents", [])]
            return sorted(keys)
        assert self.root is not None
        top = os.path.join(self.root, base)
        found = []
        for dirpath, _dirs, files in os.walk(top):
            for name in files:
                full = os.path.join(dirpath, name)
                found.append(os.path.relpath(full, os.path.join(self.root, self.prefix)))
        return sorted(found)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[tuple[str, int]]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        yield server.get_host_and_port()
    finally:
        server.stop()


def _profile_name(kind: str) -> str:
    return f"model-checkpoints-{kind}-{uuid.uuid4().hex[:8]}"


def _write_config(path: str, profile_name: str, provider: dict[str, Any]) -> None:
    import yaml

    profile: dict[str, Any] = {"storage_provider": provider, "retry": {"attempts": 1}}
    if provider["type"] == "s3":
        profile["credentials_provider"] = {
            "type": "S3Credentials",
            "options": {"access_key": ACCESS_KEY, "secret_key": SECRET_KEY},
        }
    with open(path, "w") as f:
        yaml.safe_dump({"profiles": {profile_name: profile}}, f)


def _fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RESILIENT_CKPT_RETRY_ATTEMPTS", "6")
    monkeypatch.setenv("RESILIENT_CKPT_RETRY_BASE_DELAY", "0.01")
    monkeypatch.setenv("RESILIENT_CKPT_RETRY_MAX_DELAY", "0.05")
    monkeypatch.setenv("RESILIENT_CKPT_RETRY_DEADLINE", "30")


def _s3_store(server: tuple[str, int], tmp_path: Any) -> Iterator[Store]:
    import boto3

    host, port = server
    s3 = boto3.client(
        "s3",
        endpoint_url=f"http://{host}:{port}",
        region_name=REGION,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
    )
    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=bucket)
    with FaultInjectingProxy(host, port) as proxy:
        config = str(tmp_path / "msc_config.yaml")
        provider = {
            "type": "s3",
            "options": {
                "base_path": bucket,
                "endpoint_url": proxy.endpoint,
                "region_name": REGION,
                # one try per request at this layer: the library's policy does the retrying
                "retries": {"total_max_attempts": 1, "mode": "standard"},
            },
        }
        name = _profile_name("s3")
        _write_config(config, name, provider)
        yield Store("s3", name, config, "run", proxy=proxy, s3=s3, bucket=bucket)


def _posix_store(tmp_path: Any) -> Store:
    root = tmp_path / "store"
    root.mkdir()
    config = str(tmp_path / "msc_config.yaml")
    name = _profile_name("posix")
    _write_config(config, name, {"type": "file", "options": {"base_path": str(root)}})
    return Store("posix", name, config, "run", root=str(root))


@pytest.fixture(params=["s3", "posix"])
def msc_store(
    request: pytest.FixtureRequest,
    s3_server: tuple[str, int],
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Store]:
    _fast_retries(monkeypatch)
    if request.param == "s3":
        for store in _s3_store(s3_server, tmp_path):
            monkeypatch.setenv("MSC_CONFIG", store.config_path)
            yield store
    else:
        store = _posix_store(tmp_path)
        monkeypatch.setenv("MSC_CONFIG", store.config_path)
        yield store


@pytest.fixture
def s3_store(
    s3_server: tuple[str, int], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Store]:
    _fast_retries(monkeypatch)
    for store in _s3_store(s3_server, tmp_path):
        monkeypatch.setenv("MSC_CONFIG", store.config_path)
        yield store


@pytest.fixture
def s3_and_posix_stores(
    s3_server: tuple[str, int], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Store, Store]]:
    """Both stores at once, their profiles in one MSC config, for tests that run the same
    multi-process scenario on each and would otherwise pay for two launches."""
    import yaml

    _fast_retries(monkeypatch)
    (tmp_path / "posix").mkdir()
    (tmp_path / "s3").mkdir()
    posix = _posix_store(tmp_path / "posix")
    for s3 in _s3_store(s3_server, tmp_path / "s3"):
        profiles: dict[str, Any] = {}
        for store in (s3, posix):
            with open(store.config_path) as f:
                profiles.update(yaml.safe_load(f)["profiles"])
        config = str(tmp_path / "msc_config.yaml")
        with open(config, "w") as f:
            yaml.safe_dump({"profiles": profiles}, f)
        monkeypatch.setenv("MSC_CONFIG", config)
        yield s3, posix
