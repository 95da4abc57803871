"""A real OTLP/HTTP receiver on loopback for the telemetry tests.

It accepts what OpenTelemetry's OTLP/HTTP exporters send (``POST /v1/traces`` and
``/v1/metrics``, protobuf, optionally gzip), decodes each ``ExportTraceServiceRequest`` /
``ExportMetricsServiceRequest`` with ``opentelemetry-proto`` and keeps plain records: spans
with their ids in hex, and metric points with their attributes, each with the resource's
attributes (``service.name``, the rank).
"""

from __future__ import annotations

import gzip
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    status: str
    resource: dict[str, Any]
    seconds: float


@dataclass
class Point:
    metric: str
    kind: str
    attributes: dict[str, Any]
    value: float
    resource: dict[str, Any]


@dataclass
class Received:
    spans: list[Span] = field(default_factory=list)
    points: list[Point] = field(default_factory=list)
    requests: int = 0


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


def _spans(body: bytes, into: Received) -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )
    from opentelemetry.proto.trace.v1.trace_pb2 import Status

    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope in resource_spans.scope_spans:
            for span in scope.spans:
                into.spans.append(
                    Span(
                        span.name,
                        span.trace_id.hex(),
                        span.span_id.hex(),
                        span.parent_span_id.hex(),
                        _attributes(span.attributes),
                        Status.StatusCode.Name(span.status.code),
                        resource,
                        (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9,
                    )
                )


def _points(body: bytes, into: Received) -> None:
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )

    request = ExportMetricsServiceRequest()
    request.ParseFromString(body)
    for resource_metrics in request.resource_metrics:
        resource = _attributes(resource_metrics.resource.attributes)
        for scope in resource_metrics.scope_metrics:
            for metric in scope.metrics:
                kind = metric.WhichOneof("data")
                for point in getattr(metric, kind).data_points:
                    if kind == "histogram":
                        value = float(point.count)
                    else:
                        value = float(point.as_int or point.as_double)
                    into.points.append(
                        Point(metric.name, kind, _attributes(point.attributes), value, resource)
                    )


class Receiver:
    """``with Receiver() as rx:`` serves on ``rx.url`` until the block ends."""

    def __init__(self, delay: float = 0.0) -> None:
        """``delay``: seconds each request waits before it is read (a collector that is slow)."""
        self.received = Received()
        self._lock = threading.Lock()
        self.attempts = 0  # requests that arrived, read or not yet
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                with receiver._lock:
                    receiver.attempts += 1
                time.sleep(delay)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                with receiver._lock:
                    receiver.received.requests += 1
                    if self.path == "/v1/traces":
                        _spans(body, receiver.received)
                    elif self.path == "/v1/metrics":
                        _points(body, receiver.received)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> Receiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()

    def snapshot(self) -> Received:
        with self._lock:
            return Received(
                list(self.received.spans), list(self.received.points), self.received.requests
            )
