"""The worker's side: its own SDK, configured from the ``OTEL_*`` environment and the
``otel_bootstrap`` dict (see the package docstring), its request, write and file spans, and the
bounded flush at exit."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from .._logging import get_logger
from ..config import otel_environment
from ..errors import ConfigurationError
from ._names import (
    CALL_IDX,
    CHECKPOINT,
    ERROR_TYPE,
    FILE_SPAN,
    RANK,
    REQUEST_SPAN,
    TRACER_NAME,
    WRITE_SPAN,
)

logger = get_logger(__name__)

# The keys of NVRx's and Megatron-LM's bootstrap dict that this package reads, and its own.
_BOOTSTRAP_KEYS = frozenset(
    {"enabled", "service_name", "resource_attrs", "rank", "world_size", "endpoint"}
)
# Bounds on what a collector that is down can cost the worker (seconds).
_EXPORT_TIMEOUT_S = 5.0
_FLUSH_AT_EXIT_S = 5.0


def check_bootstrap(bootstrap: Any) -> dict[str, Any] | None:
    """``otel_bootstrap`` as given to the queue or caller: None or a plain dict."""
    if bootstrap is None:
        return None
    if not isinstance(bootstrap, Mapping):
        raise ConfigurationError(
            f"otel_bootstrap must be a dict (or None), got {type(bootstrap).__name__}: it "
            "crosses into the worker process, so it holds plain values only"
        )
    unknown = set(bootstrap) - _BOOTSTRAP_KEYS
    if unknown:
        logger.debug("otel_bootstrap keys not used by the worker: %s", sorted(unknown))
    attrs = bootstrap.get("resource_attrs")
    if attrs is not None and not isinstance(attrs, Mapping):
        raise ConfigurationError(
            f"otel_bootstrap['resource_attrs'] must be a dict, got {type(attrs).__name__}"
        )
    return dict(bootstrap)


class _WorkerTelemetry:
    """The worker's tracer and provider, and the write span its file spans hang under."""

    def __init__(self, provider: Any, rank: int | None) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer(TRACER_NAME)
        self.rank = rank
        self.write_context: Any = None


_current: _WorkerTelemetry | None = None


def _env_on(env: Mapping[str, str]) -> bool:
    exporters = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporters:
        return exporters != "none"
    return bool(
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
        or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    )


def setup_worker(bootstrap: Mapping[str, Any] | None, rank: int | None) -> bool:
    """Configure the worker's SDK (once, at start-up); whether its spans are exported.

    On when the bootstrap says ``enabled`` or gives an ``endpoint``, or when the environment
    names an exporter or an OTLP endpoint; off when ``OTEL_SDK_DISABLED`` is true, when the
    traces exporter is ``none``, or when the SDK is not installed (the ``otel`` extra).
    """
    global _current
    env = otel_environment()
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    bootstrap = bootstrap or {}
    wanted = bool(bootstrap.get("enabled")) or bool(bootstrap.get("endpoint")) or _env_on(env)
    if not wanted:
        return False
    try:
        provider = _make_provider(bootstrap, rank, env)
    except ImportError as exc:
        logger.warning(
            "checkpoint worker telemetry is configured but the OpenTelemetry SDK is not "
            "installed (%s); install the 'otel' extra: pip install 'resilient-ckpt[otel]'",
            exc,
        )
        return False
    except Exception as exc:  # a broken exporter set-up must not stop checkpointing
        logger.warning("checkpoint worker telemetry disabled: %r", exc)
        return False
    if provider is None:
        return False
    from opentelemetry import trace

    trace.set_tracer_provider(provider)
    _current = _WorkerTelemetry(provider, rank)
    return True


def _make_provider(bootstrap: Mapping[str, Any], rank: int | None, env: Mapping[str, str]) -> Any:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes: dict[str, Any] = {"process.role": "checkpoint-worker"}
    attributes.update(bootstrap.get("resource_attrs") or {})
    service = bootstrap.get("service_name")
    if service:
        attributes["service.name"] = str(service)
    elif not env.get("OTEL_SERVICE_NAME", "").strip():
        attributes["service.name"] = "resilient_ckpt"
    worker_rank = bootstrap.get("rank", rank)
    if worker_rank is not None:
        attributes[RANK] = int(worker_rank)
    if bootstrap.get("world_size") is not None:
        attributes["resilient_ckpt.world_size"] = int(bootstrap["world_size"])
    exporters = [_exporter(name, bootstrap, env) for name in _exporter_names(bootstrap, env)]
    exporters = [e for e in exporters if e is not None]
    if not exporters:
        return None
    provider = TracerProvider(resource=Resource.create(attributes))
    for exporter in exporters:
        provider.add_span_processor(
            BatchSpanProcessor(exporter, export_timeout_millis=_EXPORT_TIMEOUT_S * 1000)
        )
    return provider


def _exporter_names(bootstrap: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    names = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not names or bootstrap.get("endpoint"):
        return ["otlp"]
    return [n.strip() for n in names.split(",") if n.strip() and n.strip() != "none"]


def _exporter(name: str, bootstrap: Mapping[str, Any], env: Mapping[str, str]) -> Any:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if name != "otlp":
        logger.warning("checkpoint worker: traces exporter %r is not supported; skipped", name)
        return None
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or ""
    ).strip()
    timeout = min(_float(env.get("OTEL_EXPORTER_OTLP_TIMEOUT"), 10.0), _EXPORT_TIMEOUT_S)
    if protocol == "grpc" and not bootstrap.get("endpoint"):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter(timeout=timeout)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    endpoint = bootstrap.get("endpoint")
    if endpoint:
        return OTLPSpanExporter(endpoint=f"{str(endpoint).rstrip('/')}/v1/traces", timeout=timeout)
    return OTLPSpanExporter(timeout=timeout)


def _float(text: str | None, default: float) -> float:
    try:
        return float(text) if text else default
    except ValueError:
        return default


@contextlib.contextmanager
def worker_request(call_idx: int, parent: str | None) -> Iterator[Any]:
    """The worker handles one request: :data:`REQUEST_SPAN`, a child of the trainer's save."""
    telemetry = _current
    if telemetry is None:
        yield None
        return
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    context = TraceContextTextMapPropagator().extract({"traceparent": parent}) if parent else None
    attributes = {CALL_IDX: call_idx}
    if telemetry.rank is not None:
        attributes[RANK] = telemetry.rank
    with telemetry.tracer.start_as_current_span(
        REQUEST_SPAN, context=context, attributes=attributes, record_exception=False
    ) as span:
        yield span


def fail_request(span: Any, exc_type: str, message: str) -> None:
    """Mark the worker's request span failed (the exception travels to the trainer as a value)."""
    if span is None:
        return
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute(ERROR_TYPE, exc_type)
    span.set_status(Status(StatusCode.ERROR, f"{exc_type}: {message}"[:500]))


@contextlib.contextmanager
def worker_write() -> Iterator[None]:
    """The request's ``async_fn``: :data:`WRITE_SPAN`; file spans made meanwhile hang under it."""
    telemetry = _current
    if telemetry is None:
        yield
        return
    from opentelemetry import trace

    with telemetry.tracer.start_as_current_span(WRITE_SPAN) as span:
        telemetry.write_context = trace.set_span_in_context(span)
        try:
            yield
        finally:
            telemetry.write_context = None


@contextlib.contextmanager
def file_span(name: str, sync: bool, directory: str = "") -> Iterator[Any]:
    """One data file written by the worker (any writer thread): its span, or None."""
    telemetry = _current
    if telemetry is None:
        yield None
        return
    span = telemetry.tracer.start_span(
        FILE_SPAN,
        context=telemetry.write_context,
        attributes={
            "resilient_ckpt.file": name,
            "resilient_ckpt.fsync": sync,
            CHECKPOINT: directory,
        },
    )
    try:
        yield span
    except BaseException as exc:
        from opentelemetry.trace import Status, StatusCode

        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, str(exc)[:500]))
        raise
    finally:
        span.end()


def shutdown_worker(timeout: float = _FLUSH_AT_EXIT_S) -> None:
    """Flush and stop the worker's exporters, waiting at most ``timeout`` seconds."""
    global _current
    telemetry, _current = _current, None
    if telemetry is None:
        return
    done = threading.Event()

    def _stop() -> None:
        try:
            telemetry.provider.force_flush(int(timeout * 1000))
            telemetry.provider.shutdown()
        except Exception as exc:  # what was queued is lost; the worker still exits
            logger.debug("checkpoint worker telemetry flush failed: %r", exc)
        finally:
            done.set()

    threading.Thread(target=_stop, name="resilient_ckpt-otel-flush", daemon=True).start()
    if not done.wait(timeout + 1.0):
        logger.warning("checkpoint worker: telemetry flush did not finish in %.0fs", timeout)
