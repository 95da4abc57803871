"""OpenTelemetry spans and metrics of every save, from the trainer and from its worker.

What this module decides:

* **The trainer uses only the OpenTelemetry API, and only when the application loaded it.**
  An application that exports telemetry has imported ``opentelemetry.trace`` to configure its
  SDK, so the gate of every hook is a look-up of that module in ``sys.modules``: a job
  without OpenTelemetry imports nothing and pays one dictionary look-up per hook, a few per
  save, never per tensor. Spans are made only while a real tracer provider is set (not the
  API's proxy or no-op one); metrics go through the API's instruments, which forward to the
  application's meter provider once it sets one. The alternative, importing the API
  eagerly, costs every job its import for nothing; configuring an SDK in the trainer would
  take the application's choice away from it.
* **The worker process is ours, so it configures its own SDK** (:func:`setup_worker`): from
  OpenTelemetry's standard environment variables (which the worker inherits) and from the
  ``otel_bootstrap`` dict given to ``warmup_persistent_caller`` / ``PersistentAsyncCaller``
  / ``AsyncCallsQueue`` (NVRx's keyword, a plain dict: ``enabled``, ``service_name``,
  ``resource_attrs``, ``rank``, ``world_size``, and ours, ``endpoint``: an OTLP/HTTP base
  URL). Without either, or without the SDK installed, it exports nothing. Spans leave
  through a batch processor (the save's thread only queues them) and an exporter with a
  bounded timeout; the flush at exit is bounded too, so a collector that is slow or down
  costs spans, never a save or a hang.
* **One save, one trace, across the process boundary.** The trainer's save span
  (:data:`SAVE_SPAN`) opens at the first phase of the save the library sees (the DCP
  planning, or the staging) and ends at its finalize, ``ERROR`` when it failed anywhere. Its
  context travels to the worker as a W3C ``traceparent`` string in the ``Submit`` message,
  so the worker's :data:`REQUEST_SPAN` and :data:`WRITE_SPAN` (NVRx's names, with NVRx's
  ``nvrx.call_idx``) and the per-file spans are its children.
* **Metrics are recorded by the trainer**, at finalize, where the outcome of a save is known
  on every rank, including a worker that died and so could report nothing. The worker
  exports spans only.

Names, attributes and a collector set-up are on the docs' Observability page.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any

from ._logging import get_logger
from .errors import ConfigurationError

logger = get_logger(__name__)

TRACER_NAME = "resilient_ckpt"
SAVE_SPAN = "resilient_ckpt.save"
PLAN_SPAN = "resilient_ckpt.save.plan"
STAGE_SPAN = "resilient_ckpt.save.stage"
FINALIZE_SPAN = "resilient_ckpt.save.finalize"
COMMIT_SPAN = "resilient_ckpt.save.commit"
REQUEST_SPAN = "nvrx.checkpoint.save.request"
WRITE_SPAN = "nvrx.checkpoint.save.write"
FILE_SPAN = "resilient_ckpt.write.file"
RESTORE_SPAN = "resilient_ckpt.restore"

RANK = "resilient_ckpt.rank"
FLOW = "resilient_ckpt.flow"
CALL_IDX = "nvrx.call_idx"
CHECKPOINT = "resilient_ckpt.checkpoint_id"
STEP = "resilient_ckpt.step"
BYTES = "resilient_ckpt.bytes"
FILES = "resilient_ckpt.files"
ERROR_TYPE = "error.type"
FAILED_RANKS = "resilient_ckpt.failed_ranks"

# The keys of NVRx's and Megatron-LM's bootstrap dict that this package reads, and its own.
_BOOTSTRAP_KEYS = frozenset(
    {"enabled", "service_name", "resource_attrs", "rank", "world_size", "endpoint"}
)
# Bounds on what a collector that is down can cost the worker (seconds).
_EXPORT_TIMEOUT_S = 5.0
_FLUSH_AT_EXIT_S = 5.0


# -- trainer side ---------------------------------------------------------------------------


# The tracer of the provider it came from: a provider's get_tracer is not cheap.
_tracer_of: tuple[Any, Any] = (None, None)
# What an off hook returns: one shared no-op context manager, no generator per call.
_OFF = contextlib.nullcontext()


def _tracer() -> Any:
    """The library's tracer when the application set a real tracer provider, else None."""
    global _tracer_of
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None or _suspended:
        return None
    provider = trace.get_tracer_provider()
    cached_provider, tracer = _tracer_of
    if provider is cached_provider:
        return tracer
    if isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return None
    tracer = provider.get_tracer(TRACER_NAME)
    _tracer_of = (provider, tracer)
    return tracer


_suspended = False


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Saves in the block record nothing, even with an SDK configured (the stall benchmark's
    telemetry-off rows, timed in the same processes as its telemetry-on row)."""
    global _suspended
    previous, _suspended = _suspended, True
    try:
        yield
    finally:
        _suspended = previous


def _loaded() -> bool:
    if _suspended:
        return False
    modules = sys.modules
    return "opentelemetry.trace" in modules or "opentelemetry.metrics" in modules


def _rank() -> int:
    from . import _dist

    return _dist.rank()


class SaveTrace:
    """One save's span (None while tracing is off) and the attributes its metrics carry."""

    __slots__ = ("attributes", "span")

    def __init__(self, flow: str, attributes: Mapping[str, Any]) -> None:
        self.attributes: dict[str, Any] = {RANK: _rank(), FLOW: flow}
        self.attributes.update(attributes)
        tracer = _tracer()
        self.span = (
            tracer.start_span(SAVE_SPAN, attributes=self.attributes) if tracer is not None else None
        )

    def set(self, **attributes: Any) -> None:
        self.attributes.update(attributes)
        if self.span is not None:
            self.span.set_attributes(attributes)

    def traceparent(self) -> str | None:
        if self.span is None:
            return None
        ctx = self.span.get_span_context()
        if not ctx.is_valid:
            return None
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"

    def phase(self, name: str) -> AbstractContextManager[Any]:
        """A child span of the save, current while the block runs; records an exception."""
        tracer = _tracer() if self.span is not None else None
        if tracer is None:
            return _OFF
        parent = sys.modules["opentelemetry.trace"].set_span_in_context(self.span)
        return tracer.start_as_current_span(name, context=parent)  # type: ignore[no-any-return]

    def end(self, error: BaseException | None) -> None:
        if self.span is None:
            return
        trace = sys.modules["opentelemetry.trace"]
        if error is not None:
            self.span.record_exception(error)
            self.span.set_attribute(ERROR_TYPE, _error_type(error))
            failed = getattr(error, "failed_ranks", None)
            if failed:
                self.span.set_attribute(FAILED_RANKS, [int(r) for r in failed])
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, str(error)[:500]))
        self.span.end()
        self.span = None


def _error_type(error: BaseException) -> str:
    return f"{type(error).__module__}.{type(error).__qualname__}"


_local = threading.local()
# Each caller's saves between their scheduling and their finalize, by call index.
_open: weakref.WeakKeyDictionary[Any, dict[int, SaveTrace]] = weakref.WeakKeyDictionary()
_MAX_OPEN = 256


def prepare_save(flow: str, **attributes: Any) -> SaveTrace | None:
    """Open the save this thread is about to schedule (the outermost flow names it: a tiered
    save plans through the DCP planner, and stays ``tiered``). None when telemetry is off."""
    if not _loaded():
        return None
    pending: SaveTrace | None = getattr(_local, "pending", None)
    if pending is None:
        pending = SaveTrace(flow, attributes)
        _local.pending = pending
    elif attributes:
        pending.set(**attributes)
    return pending


def abandon_save(error: BaseException) -> None:
    """The save this thread prepared failed before it was scheduled."""
    pending: SaveTrace | None = getattr(_local, "pending", None)
    _local.pending = None
    if pending is not None:
        pending.end(error)
        _record_outcome(pending.attributes, error)


def save_phase(
    name: str, flow: str, save_attributes: Mapping[str, Any] | None = None
) -> AbstractContextManager[Any]:
    """A phase of a save before it is scheduled (the planning): its span, and on an exception
    the whole save ends as failed."""
    pending = prepare_save(flow, **(save_attributes or {}))
    return _OFF if pending is None else _pending_phase(pending, name)


@contextlib.contextmanager
def _pending_phase(pending: SaveTrace, name: str) -> Iterator[Any]:
    try:
        with pending.phase(name) as span:
            yield span
    except BaseException as exc:
        abandon_save(exc)
        raise


def span(name: str, **attributes: Any) -> AbstractContextManager[Any]:
    """A span under the current one (the commit, inside the finalize span), or None."""
    tracer = _tracer()
    if tracer is None:
        return _OFF
    return tracer.start_as_current_span(name, attributes=attributes)  # type: ignore[no-any-return]


def begin_save(caller: Any, call_idx: int) -> SaveTrace | None:
    """The caller schedules ``call_idx``: adopt the save this thread prepared (or open one)."""
    if not _loaded():
        return None
    pending: SaveTrace | None = getattr(_local, "pending", None)
    _local.pending = None
    save = pending if pending is not None else SaveTrace("async", {})
    save.set(**{CALL_IDX: call_idx})
    saves = _open.setdefault(caller, {})
    saves[call_idx] = save
    if len(saves) > _MAX_OPEN:  # calls nobody finalized (a queue dropped unclosed)
        saves.pop(next(iter(saves))).end(None)
    return save


def save_of(caller: Any, call_idx: int) -> SaveTrace | None:
    saves = _open.get(caller) if _loaded() else None
    return saves.get(call_idx) if saves else None


def traceparent(caller: Any, call_idx: int) -> str | None:
    """The W3C trace context for the worker's spans of ``call_idx``; None when not traced."""
    save = save_of(caller, call_idx)
    return save.traceparent() if save is not None else None


def phase(caller: Any, call_idx: int, name: str) -> AbstractContextManager[Any]:
    """A child span of a scheduled save (the staging); an exception ends the save as failed."""
    save = save_of(caller, call_idx)
    return _OFF if save is None else _scheduled_phase(save, caller, call_idx, name)


@contextlib.contextmanager
def _scheduled_phase(save: SaveTrace, caller: Any, call_idx: int, name: str) -> Iterator[None]:
    try:
        with save.phase(name):
            yield
    except BaseException as exc:
        end_save(caller, call_idx, None, exc)
        raise


def finalizing(caller: Any, call_idx: int) -> AbstractContextManager[Any]:
    """The finalize functions of ``call_idx``; an exception ends the save as failed."""
    return _OFF if not _loaded() else _finalizing(caller, call_idx)


@contextlib.contextmanager
def _finalizing(caller: Any, call_idx: int) -> Iterator[None]:
    save = save_of(caller, call_idx)
    try:
        with save.phase(FINALIZE_SPAN) if save is not None else _OFF:
            yield
    except BaseException as exc:
        end_save(caller, call_idx, None, exc)
        raise


def end_save(
    caller: Any,
    call_idx: int,
    stats: Mapping[str, float] | None,
    error: BaseException | None = None,
) -> None:
    """``call_idx`` was finalized (``error`` None) or failed: end its span, record its metrics.

    ``stats``: the queue's timings of the call (``stall``, ``write``, ``finalize``, ``bytes``).
    """
    if not _loaded():
        return
    saves = _open.get(caller)
    save = saves.pop(call_idx, None) if saves else None
    if save is None:  # a caller that does not trace its calls (the fork per request)
        save = getattr(_local, "pending", None)
        _local.pending = None
    attributes = save.attributes if save is not None else {RANK: _rank(), FLOW: "async"}
    if save is not None:
        if stats and "bytes" in stats:
            save.set(**{BYTES: int(stats["bytes"])})
        save.end(error)
    _record_outcome(attributes, error, stats)


def restore_done(flow: str, nbytes: int, seconds: float, **attributes: Any) -> None:
    """A restore read ``nbytes`` from storage in ``seconds`` (its span, ended now)."""
    if not _loaded():
        return
    common: dict[str, Any] = {RANK: _rank(), FLOW: flow}
    _instruments().restore_bytes.add(int(nbytes), common)
    tracer = _tracer()
    if tracer is None:
        return
    end = time.time_ns()
    span = tracer.start_span(
        RESTORE_SPAN,
        attributes={**common, BYTES: int(nbytes), **attributes},
        start_time=end - int(seconds * 1e9),
    )
    span.end(end_time=end)


class _Instruments:
    def __init__(self) -> None:
        from opentelemetry import metrics

        meter = metrics.get_meter(TRACER_NAME)
        self.stall = meter.create_histogram(
            "resilient_ckpt.save.stall", unit="s", description="time a save blocked training"
        )
        self.write = meter.create_histogram(
            "resilient_ckpt.save.write", unit="s", description="the worker's write of a save"
        )
        self.finalize = meter.create_histogram(
            "resilient_ckpt.save.finalize", unit="s", description="a save's finalize and commit"
        )
        self.save_bytes = meter.create_counter(
            "resilient_ckpt.save.bytes", unit="By", description="bytes staged and written"
        )
        self.restore_bytes = meter.create_counter(
            "resilient_ckpt.restore.bytes", unit="By", description="bytes read by restores"
        )
        self.committed = meter.create_counter(
            "resilient_ckpt.save.committed", unit="{save}", description="saves committed"
        )
        self.failed = meter.create_counter(
            "resilient_ckpt.save.failed", unit="{save}", description="saves failed"
        )


_instruments_lock = threading.Lock()
_made: _Instruments | None = None


def _instruments() -> _Instruments:
    global _made
    if _made is None:
        with _instruments_lock:
            if _made is None:
                _made = _Instruments()
    return _made


def _record_outcome(
    attributes: Mapping[str, Any],
    error: BaseException | None,
    stats: Mapping[str, float] | None = None,
) -> None:
    common = {RANK: attributes.get(RANK, 0), FLOW: attributes.get(FLOW, "async")}
    made = _instruments()
    if error is not None:
        made.failed.add(1, {**common, ERROR_TYPE: _error_type(error)})
        return
    made.committed.add(1, common)
    stats = stats or {}
    for key, histogram in (
        ("stall", made.stall),
        ("write", made.write),
        ("finalize", made.finalize),
    ):
        if key in stats:
            histogram.record(float(stats[key]), common)
    if "bytes" in stats:
        made.save_bytes.add(int(stats["bytes"]), common)


# -- the bootstrap dict ---------------------------------------------------------------------


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


# -- worker side ----------------------------------------------------------------------------


class _WorkerTelemetry:
    """The worker's tracer and provider, and the write span its file spans hang under."""

    def __init__(self, provider: Any, rank: int | None) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer(TRACER_NAME)
        self.rank = rank
        self.write_context: Any = None


_worker: _WorkerTelemetry | None = None


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
    global _worker
    env = os.environ
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
    _worker = _WorkerTelemetry(provider, rank)
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
    telemetry = _worker
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
    telemetry = _worker
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
def file_span(name: str, sync: bool) -> Iterator[Any]:
    """One data file written by the worker (any writer thread): its span, or None."""
    telemetry = _worker
    if telemetry is None:
        yield None
        return
    span = telemetry.tracer.start_span(
        FILE_SPAN,
        context=telemetry.write_context,
        attributes={"resilient_ckpt.file": name, "resilient_ckpt.fsync": sync},
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
    global _worker
    telemetry, _worker = _worker, None
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
