"""The trainer's side: OpenTelemetry API calls only, each hook gated on the application having
loaded OpenTelemetry (see the package docstring); one :class:`SaveTrace` per save, from its
first phase to its finalize; the metrics, recorded at finalize."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any

from ._names import (
    BYTES,
    CALL_IDX,
    ERROR_TYPE,
    FAILED_RANKS,
    FINALIZE_SPAN,
    FLOW,
    RANK,
    RESTORE_SPAN,
    SAVE_SPAN,
    TRACER_NAME,
)

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
    from .. import _dist

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


def span_of(caller: Any, call_idx: int) -> Any:
    """The span of a scheduled save (None when not traced), to parent work on other threads."""
    save = save_of(caller, call_idx)
    return save.span if save is not None else None


def child_span(parent: Any, name: str, **attributes: Any) -> AbstractContextManager[Any]:
    """A child of ``parent`` (from :func:`span_of`) made on another thread, current there while
    the block runs; an exception is recorded and sets its status ``ERROR``."""
    tracer = _tracer() if parent is not None else None
    if tracer is None:
        return _OFF
    context = sys.modules["opentelemetry.trace"].set_span_in_context(parent)
    return tracer.start_as_current_span(name, context=context, attributes=attributes)  # type: ignore[no-any-return]


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
