"""OpenTelemetry spans and metrics of every save, from the trainer and from its worker.

What this package decides (:mod:`._trainer` the trainer's side, :mod:`._worker` the worker's,
:mod:`._names` what both emit):

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

from ._names import (
    BYTES,
    CALL_IDX,
    CHECKPOINT,
    COMMIT_SPAN,
    ERROR_TYPE,
    FAILED_RANKS,
    FILE_SPAN,
    FINALIZE_SPAN,
    FLOW,
    PLAN_SPAN,
    RANK,
    REPLICATE_SPAN,
    REQUEST_SPAN,
    RESTORE_SPAN,
    SAVE_SPAN,
    STAGE_SPAN,
    STEP,
    TRACER_NAME,
    WRITE_SPAN,
)
from ._trainer import (
    SaveTrace,
    abandon_save,
    begin_save,
    child_span,
    end_save,
    finalizing,
    phase,
    prepare_save,
    restore_done,
    save_of,
    save_phase,
    span,
    span_of,
    suspended,
    traceparent,
)
from ._worker import (
    check_bootstrap,
    fail_request,
    file_span,
    setup_worker,
    shutdown_worker,
    worker_request,
    worker_write,
)

__all__ = [
    "BYTES",
    "CALL_IDX",
    "CHECKPOINT",
    "COMMIT_SPAN",
    "ERROR_TYPE",
    "FAILED_RANKS",
    "FILE_SPAN",
    "FINALIZE_SPAN",
    "FLOW",
    "PLAN_SPAN",
    "RANK",
    "REPLICATE_SPAN",
    "REQUEST_SPAN",
    "RESTORE_SPAN",
    "SAVE_SPAN",
    "STAGE_SPAN",
    "STEP",
    "TRACER_NAME",
    "WRITE_SPAN",
    "SaveTrace",
    "abandon_save",
    "begin_save",
    "check_bootstrap",
    "child_span",
    "end_save",
    "fail_request",
    "file_span",
    "finalizing",
    "phase",
    "prepare_save",
    "restore_done",
    "save_of",
    "save_phase",
    "setup_worker",
    "shutdown_worker",
    "span",
    "span_of",
    "suspended",
    "traceparent",
    "worker_request",
    "worker_write",
]
