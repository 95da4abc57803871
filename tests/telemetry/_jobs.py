"""Rank functions of the telemetry tests (module-level: the launched ranks import them).

Each rank configures its own OpenTelemetry SDK the way an application does (unless the SDK
is blocked), points its worker at the test's receiver (environment or ``otel_bootstrap``),
saves, and returns plain facts.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from resilient_ckpt.async_ckpt.cached_metadata_filesystem_reader import (
    CachedMetadataFileSystemReader,
)
from resilient_ckpt.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from resilient_ckpt.async_ckpt.filesystem_async import FileSystemWriterAsync
from resilient_ckpt.async_ckpt.state_dict_saver import (
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from resilient_ckpt.config import Timeouts
from resilient_ckpt.errors import CheckpointingException
from resilient_ckpt.local import BasicTensorAwareStateDict, LocalCheckpointManager
from tests import _helpers

FAST = Timeouts(worker_start=90, finalize=60, collective=60, shutdown=20, poll_interval=0.02)


def trainer_sdk(url: str, rank: int) -> tuple[Any, Any] | None:
    """The application's SDK: spans and metrics to ``url`` over OTLP/HTTP; None without one."""
    try:
        from opentelemetry import metrics, trace
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        return None
    resource = Resource.create({"service.name": "trainer", "test.rank": rank})
    tracer_provider = TracerProvider(resource=resource)
    tracer_provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{url}/v1/traces", timeout=5))
    )
    trace.set_tracer_provider(tracer_provider)
    reader = PeriodicExportingMetricReader(
        OTLPMetricExporter(endpoint=f"{url}/v1/metrics", timeout=5),
        export_interval_millis=600_000,
    )
    meter_provider = MeterProvider(resource=resource, metric_readers=[reader])
    metrics.set_meter_provider(meter_provider)
    return tracer_provider, meter_provider


def _flush(providers: tuple[Any, Any] | None) -> None:
    if providers is not None:
        for provider in providers:
            provider.shutdown()


def _dcp_save(queue: AsyncCallsQueue, state: dict, path: str) -> None:
    writer = FileSystemWriterAsync(path, thread_count=2)
    plan = save_state_dict_async_plan(state, writer, enable_cache=True)
    save_fn, preload_fn, save_args = writer.get_save_function_and_args()
    finalize = [functools.partial(save_state_dict_async_finalize, *plan)]
    queue.schedule_async_request(AsyncRequest(save_fn, save_args, finalize, preload_fn=preload_fn))
    queue.maybe_finalize_async_calls(blocking=True)


def dcp_saves(rank: int, world: int, root: str, url: str, how: str) -> dict[str, Any]:
    """Two async DCP saves, an async local one, then a save whose write fails on rank 1.

    ``how``: ``env`` (the worker reads OTEL_EXPORTER_OTLP_ENDPOINT), ``bootstrap`` (the
    worker is warmed up with ``otel_bootstrap``), ``blocked`` (the SDK cannot be imported).
    """
    if how == "bootstrap":
        AsyncCallsQueue.warmup_persistent_caller(
            rank,
            otel_bootstrap={
                "enabled": True,
                "endpoint": url,
                "service_name": "bootstrapped-worker",
                "rank": rank,
                "world_size": world,
                "span_groups": "checkpoint",  # Megatron's key: accepted, not used
            },
        )
    else:
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = url
        os.environ["OTEL_SERVICE_NAME"] = "env-worker"
    providers = trainer_sdk(url, rank)
    queue = AsyncCallsQueue(timeouts=FAST)
    state = {f"r{rank}.w": torch.full((4096,), float(rank)), f"r{rank}.b": torch.arange(100.0)}
    for i in range(2):
        _dcp_save(queue, state, os.path.join(root, f"ckpt{i}"))
    local = LocalCheckpointManager(os.path.join(root, "local"), "telemetry")
    queue.schedule_async_request(local.save(BasicTensorAwareStateDict(state), 7, is_async=True))
    queue.maybe_finalize_async_calls(blocking=True)
    failed = None
    request = AsyncRequest(
        _helpers.fail_on_rank, (1, rank, os.path.join(root, f"bad{rank}.pt"), state), []
    )
    queue.schedule_async_request(request)
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except CheckpointingException as exc:
        failed = type(exc).__name__
    queue.close()
    loaded = {key: torch.empty_like(value) for key, value in state.items()}
    dcp.load(loaded, storage_reader=CachedMetadataFileSystemReader(os.path.join(root, "ckpt1")))
    _flush(providers)
    return {
        "failed": failed,
        "exact": all(torch.equal(loaded[k], state[k]) for k in state),
        "sdk_imported": "opentelemetry.sdk" in sys.modules,
    }


def tiered_saves(rank: int, world: int, root: str, url: str) -> dict[str, Any]:
    """Two tiered saves (the second durable), then a restore in a fresh manager."""
    from resilient_ckpt.tiered import TieredCheckpointManager

    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = url
    providers = trainer_sdk(url, rank)
    options: dict[str, Any] = {"replication_factor": 2, "replication_jump": 1, "durable_every": 2}
    mem, durable = os.path.join(root, "mem"), os.path.join(root, "durable")
    mgr = TieredCheckpointManager(mem, durable, **options)
    key = f"r{rank}.w"  # per-rank keys: equal keys would be one replicated tensor
    state = {key: torch.full((2048,), float(rank))}
    for step in (1, 2):
        mgr.save(state, step)
        mgr.maybe_finalize(blocking=True)
    mgr.close()
    fresh = TieredCheckpointManager(mem, durable, **options)
    into = {key: torch.zeros(2048)}
    restored = fresh.load(into)
    fresh.close()
    _flush(providers)
    return {"restored": restored, "exact": torch.equal(into[key], state[key])}


def saves_with_a_slow_collector(rank: int, world: int, root: str, url: str) -> dict[str, Any]:
    """The worker exports to a collector that answers nothing in time: the saves and the
    worker's exit take their usual time, its flush at exit is bounded."""
    import time

    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = url
    queue = AsyncCallsQueue(timeouts=FAST)
    state = {f"r{rank}.w": torch.full((4096,), float(rank))}
    started = time.monotonic()
    for i in range(3):
        _dcp_save(queue, state, os.path.join(root, f"ckpt{i}"))
    saves_s = time.monotonic() - started
    started = time.monotonic()
    queue.close()
    return {"saves_s": saves_s, "close_s": time.monotonic() - started}
