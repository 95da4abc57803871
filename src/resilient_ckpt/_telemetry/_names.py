"""The names the telemetry emits: spans and attributes (the docs' Observability page)."""

from __future__ import annotations

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
REPLICATE_SPAN = "resilient_ckpt.tiered.replicate"

RANK = "resilient_ckpt.rank"
FLOW = "resilient_ckpt.flow"
CALL_IDX = "nvrx.call_idx"
CHECKPOINT = "resilient_ckpt.checkpoint_id"
STEP = "resilient_ckpt.step"
BYTES = "resilient_ckpt.bytes"
ERROR_TYPE = "error.type"
FAILED_RANKS = "resilient_ckpt.failed_ranks"
