"""What the stall benchmark (:mod:`resilient_ckpt.cli.bench_stall`) times: each rank's state,
its references (:mod:`.stall_refs`), and one save of every flow, ours and torch's, as
:class:`Flows` methods."""

from __future__ import annotations

import functools
import os
import shutil
import statistics
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...errors import CheckpointingException
from ._output import dropping_torch_info
from .stall_refs import Memcpy, PinnedCopy

_torch_executor_started = False  # torch's dcp.async_save process, one per rank process

# The shapes of DESIGN.md's stall targets. 1G/2000 is the realistic one (a gigabyte per rank
# in thousands of tensors): a cache or fast path stays only if it shows there (STYLE.md 13).
SHAPES = {
    "2M/64": (2 << 20, 64),
    "64M/2000": (64 << 20, 2000),
    "256M/8": (256 << 20, 8),
    "1G/2000": (1 << 30, 2000),
}
# What a run measures unless --shapes says otherwise: 1G/2000 needs ~4 GiB per rank.
DEFAULT_SHAPES = ("2M/64", "64M/2000", "256M/8")


@dataclass(frozen=True)
class Config:
    root: str
    shapes: tuple[str, ...]
    reps: int
    warmups: int
    memory_saves: int
    first_trials: int = 3
    gap_s: float = 0.1
    device: str = "cpu"
    skip: tuple[str, ...] = ()  # flows left out (by name)


def _device(rank: int, kind: str) -> torch.device:
    """This rank's device: the CPU, or CUDA device ``rank % count`` (ranks may share one)."""
    if kind == "cpu":
        return torch.device("cpu")
    index = rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _state(
    rank: int, world: int, nbytes: int, tensors: int, device: torch.device
) -> tuple[dict, dict]:
    from torch.distributed.device_mesh import init_device_mesh

    from ..._torch_compat import DTensor, Shard

    mesh = init_device_mesh(device.type, (world,))
    numel = max(1, nbytes // tensors // 4)
    g = torch.Generator().manual_seed(rank)
    local = {f"layer{i}.weight": torch.rand(numel, generator=g).to(device) for i in range(tensors)}
    sharded: dict[str, Any] = {
        k: DTensor.from_local(v, mesh, [Shard(0)], run_check=False) for k, v in local.items()
    }
    sharded["step"] = 0
    return sharded, {"model": local, "step": 0}


class Flows:
    """One save per flow; each returns {figure: seconds} for this rank."""

    def __init__(self, rank: int, world: int, cfg: Config, shape: str) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        nbytes, tensors = SHAPES[shape]
        self.rank, self.cfg = rank, cfg
        self.dir = os.path.join(cfg.root, shape.replace("/", "_"))
        os.makedirs(self.dir, exist_ok=True)
        device = _device(rank, cfg.device)
        self.sharded, self.local = _state(rank, world, nbytes, tensors, device)
        reference = PinnedCopy if device.type == "cuda" else Memcpy
        self.memcpy: Memcpy | PinnedCopy = reference(list(self.local["model"].values()))
        # CPU: the same copy by as many threads as our copy pool has (see ``copy_threads``).
        self.parallel: Memcpy | None = None
        if device.type == "cpu":
            from ...async_ckpt._copy import default_copy_threads

            model = list(self.local["model"].values())
            self.parallel = Memcpy(model, threads=default_copy_threads())
        self.n = 0
        # First saves after the documented warm-up, each on fresh objects; the last trial's
        # objects serve the steady-state saves.
        firsts: dict[str, list[float]] = {}
        for trial in range(cfg.first_trials):
            if trial:
                self._close_flows()
            self._open_flows(trial)
            firsts.setdefault("ours torch", []).append(self.torch_async()["stall"])
            firsts.setdefault("ours DCP", []).append(self.ours_dcp()["stall"])
            firsts.setdefault("ours local", []).append(self.ours_local()["stall"])
        self.first = {name: statistics.median(values) for name, values in firsts.items()}
        # torch's stager as its docs advise for the device: on CUDA pinned memory and
        # non-blocking copies (and, for the overlapped row, its background staging).
        cuda = device.type == "cuda"
        self.stager_options = {
            False: StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=True,
                use_async_staging=False,
                use_non_blocking_copy=cuda,
            ),
            True: StagingOptions(),
        }
        self.stager = DefaultStager(self.stager_options[False])
        from ...dcp import Stager

        self.rc_stager = Stager()
        self.overlap_stager = DefaultStager(self.stager_options[True]) if cuda else None
        # Reference flows whose stager failed when reused: each save then makes its own
        # (torch's default when no stager is passed), its set-up counted in the stall.
        self.fresh_stagers: set[bool] = set()

    def _open_flows(self, trial: int) -> None:
        """Fresh checkpointing objects, each warmed up as documented."""
        from ...async_ckpt.core import AsyncCallsQueue
        from ...async_ckpt.state_dict_saver import CheckpointMetadataCache
        from ...async_ckpt.torch_ckpt import TorchAsyncCheckpoint
        from ...async_ckpt.warmup import warmup_async_save
        from ...local import BasicTensorAwareStateDict, LocalCheckpointManager

        self.torch_ckpt = TorchAsyncCheckpoint()
        self.torch_ckpt.warmup(self.local)
        self.queue = AsyncCallsQueue()
        self.cache = CheckpointMetadataCache()
        warmup_async_save(self.sharded, self.queue, metadata_cache=self.cache, thread_count=2)
        self.local_queue = AsyncCallsQueue()
        self.manager = LocalCheckpointManager(os.path.join(self.dir, f"local{trial}"), "bench")
        self.manager.warmup(BasicTensorAwareStateDict(self.local), self.local_queue)

    def _close_flows(self) -> None:
        self.torch_ckpt.close()
        self.queue.close()
        self.local_queue.close()

    def _next_step(self) -> None:
        """A new save: its step, as a training loop's, is a new value in the state."""
        self.n += 1
        self.sharded["step"] = self.local["step"] = self.n

    def _path(self, name: str) -> str:
        self._next_step()
        return os.path.join(self.dir, f"{name}{self.n}")

    def _cleanup(self, path: str) -> None:
        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)

    @staticmethod
    def _finalize(finalize: Callable[[], Any], pending: Callable[[], int]) -> float:
        """Seconds of the non-blocking finalize call that commits the save, polled as a
        training loop polls (one call a step), so the background write's own time is not
        in it: what the trainer's thread pays for the commit. Collective where ``finalize``
        is: every rank leaves the loop at the same call."""
        while True:
            started = time.perf_counter()
            finalize()
            took = time.perf_counter() - started
            if not pending():
                return took
            time.sleep(0.002)

    def copy(self) -> dict[str, float]:
        dist.barrier()
        return {"stall": self.memcpy()}

    def copy_threads(self) -> dict[str, float]:
        """The CPU reference copied by our copy pool's number of threads (``threads``:
        1 where each rank has one core, e.g. 2 ranks on 2 cores)."""
        if self.parallel is None:
            raise CheckpointingException("the multi-thread memcpy is a CPU reference")
        dist.barrier()
        return {"stall": self.parallel(), "threads": float(self.parallel.threads)}

    def ours_dcp(self, overlap: bool = False, defer: bool = False) -> dict[str, float]:
        from ...async_ckpt.core import AsyncRequest
        from ...async_ckpt.filesystem_async import FileSystemWriterAsync
        from ...async_ckpt.state_dict_saver import (
            save_state_dict_async_finalize,
            save_state_dict_async_plan,
        )

        path = self._path("dcp")
        dist.barrier()
        started = time.perf_counter()
        writer = FileSystemWriterAsync(path, thread_count=2)
        ret = save_state_dict_async_plan(
            self.sharded, writer, enable_cache=True, metadata_cache=self.cache, defer_planning=defer
        )
        save_fn, preload_fn, args = writer.get_save_function_and_args()
        finalize = functools.partial(save_state_dict_async_finalize, *ret)
        request = AsyncRequest(save_fn, args, [finalize], preload_fn=preload_fn)
        self.queue.schedule_async_request(request, overlap_staging=overlap)
        stall = time.perf_counter() - started
        self.queue.wait_for_snapshot()
        snapshot = time.perf_counter() - started
        finalize_s = self._finalize(
            self.queue.maybe_finalize_async_calls, self.queue.get_num_unfinalized_calls
        )
        self._cleanup(path)
        return {"stall": stall, "snapshot": snapshot, "finalize": finalize_s}

    def ours_dcp_telemetry(self) -> dict[str, float]:
        """``ours DCP`` with the trainer's telemetry on (see :func:`install_telemetry`)."""
        return self.ours_dcp()

    def ours_dcp_overlap(self) -> dict[str, float]:
        return self.ours_dcp(overlap=True)

    def ours_dcp_overlap_defer(self) -> dict[str, float]:
        return self.ours_dcp(overlap=True, defer=True)

    def torch_async(self, overlap: bool = False) -> dict[str, float]:
        path = self._path(f"rank{self.rank}_pt")
        dist.barrier()
        started = time.perf_counter()
        self.torch_ckpt.async_save(self.local, path, overlap_staging=overlap)
        stall = time.perf_counter() - started
        self.torch_ckpt.wait_for_snapshot()
        snapshot = time.perf_counter() - started
        finalize_s = self._finalize(
            self.torch_ckpt.finalize_async_save, self.torch_ckpt.queue.get_num_unfinalized_calls
        )
        dist.barrier()
        os.unlink(path)
        return {"stall": stall, "snapshot": snapshot, "finalize": finalize_s}

    def torch_async_overlap(self) -> dict[str, float]:
        return self.torch_async(overlap=True)

    def ours_local(self, overlap: bool = False, defer: bool = False) -> dict[str, float]:
        from ...local import BasicTensorAwareStateDict

        self._next_step()
        dist.barrier()
        started = time.perf_counter()
        self.manager.defer_planning = defer
        request = self.manager.save(BasicTensorAwareStateDict(self.local), self.n, True)
        if request is None:  # is_async=True always returns the request
            raise CheckpointingException("LocalCheckpointManager.save(is_async=True) gave None")
        self.local_queue.schedule_async_request(request, overlap_staging=overlap)
        stall = time.perf_counter() - started
        self.local_queue.wait_for_snapshot()
        snapshot = time.perf_counter() - started
        finalize_s = self._finalize(
            self.local_queue.maybe_finalize_async_calls,
            self.local_queue.get_num_unfinalized_calls,
        )
        return {"stall": stall, "snapshot": snapshot, "finalize": finalize_s}

    def ours_local_overlap(self) -> dict[str, float]:
        return self.ours_local(overlap=True)

    def ours_local_overlap_defer(self) -> dict[str, float]:
        return self.ours_local(overlap=True, defer=True)

    def dcp_async_save(self, overlap: bool = False) -> dict[str, float]:
        global _torch_executor_started
        if _torch_executor_started:
            return self._dcp_async_save(overlap)
        # The first save starts torch's executor process (from a thread of torch's, once the
        # call returned): with stderr filtered until the save is done, which the process
        # keeps (it logs every request at INFO).
        with dropping_torch_info():
            figures = self._dcp_async_save(overlap)
        _torch_executor_started = True
        return figures

    def _dcp_async_save(self, overlap: bool) -> dict[str, float]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
        from torch.distributed.checkpoint.staging import DefaultStager
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        path = self._path("torch_dcp")
        fresh = overlap in self.fresh_stagers
        dist.barrier()
        started = time.perf_counter()
        stager: Any = self.overlap_stager if overlap else self.stager
        if fresh:
            stager = DefaultStager(self.stager_options[overlap])
        response = dcp.async_save(
            self.sharded,
            storage_writer=dcp.FileSystemWriter(path, thread_count=2),
            planner=DefaultSavePlanner(enable_plan_caching=True),
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=stager,
        )
        stall = time.perf_counter() - started
        # Background staging answers with two futures (torch >= 2.9), else one.
        staged = getattr(response, "staging_completion", None)
        if staged is not None:
            staged.result()
        snapshot = time.perf_counter() - started
        upload: Any = getattr(response, "upload_completion", response)
        upload.result()
        if fresh:
            stager.close()
        self._cleanup(path)
        return {"stall": stall, "snapshot": snapshot}

    def dcp_async_save_overlap(self) -> dict[str, float]:
        return self.dcp_async_save(overlap=True)

    def ours_dcp_native(self) -> dict[str, float]:
        """``resilient_ckpt.dcp.async_save`` called as torchtitan calls torch's (a checkpoint
        id and the process executor): the call is the stall; ``result()`` commits."""
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        from ... import dcp as rdcp

        path = self._path("native")
        dist.barrier()
        started = time.perf_counter()
        future = rdcp.async_save(
            self.sharded, checkpoint_id=path, async_checkpointer_type=AsyncCheckpointerType.PROCESS
        )
        stall = time.perf_counter() - started
        if not isinstance(future, Future):  # no background stager: a Future, as torch's
            raise CheckpointingException(f"resilient_ckpt.dcp.async_save answered {future!r}")
        future.result()
        self._cleanup(path)
        return {"stall": stall}

    def dcp_async_save_stager(self) -> dict[str, float]:
        """torch's ``dcp.async_save`` exactly as the ``dcp.async_save`` flow, with our
        ``Stager`` in place of torch's ``DefaultStager``."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        path = self._path("torch_dcp_stager")
        dist.barrier()
        started = time.perf_counter()
        future = dcp.async_save(
            self.sharded,
            storage_writer=dcp.FileSystemWriter(path, thread_count=2),
            planner=DefaultSavePlanner(enable_plan_caching=True),
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=self.rc_stager,
        )
        stall = time.perf_counter() - started
        if not isinstance(future, Future):  # a synchronous stager: a Future
            raise CheckpointingException(f"dcp.async_save with our Stager answered {future!r}")
        future.result()
        self._cleanup(path)
        return {"stall": stall, "arenas": float(self.rc_stager.arena_count)}

    def memory(self, saves: int) -> dict[str, float]:
        import psutil

        from ...async_ckpt._arena import open_arena_fds as memfds

        proc = psutil.Process()
        self.torch_async()
        rss0, fds0 = proc.memory_info().rss, memfds()
        peak = rss0
        for _ in range(saves):
            self.torch_async()
            peak = max(peak, proc.memory_info().rss)
        return {"rss_growth": (peak - rss0) / rss0, "new_memfds": float(memfds() - fds0)}

    def close(self) -> None:
        from ... import dcp as rdcp

        self._close_flows()
        rdcp.close()
        self.rc_stager.close()
        self.stager.close()
        if self.overlap_stager is not None:
            self.overlap_stager.close()
        self.memcpy.close()
        if self.parallel is not None:
            self.parallel.close()


TELEMETRY_FLOW = "ours DCP telemetry"
FLOWS: dict[str, Callable[[Flows], dict[str, float]]] = {
    "memcpy": Flows.copy,
    "ours DCP": Flows.ours_dcp,
    TELEMETRY_FLOW: Flows.ours_dcp_telemetry,
    "ours torch": Flows.torch_async,
    "ours local": Flows.ours_local,
    "dcp.async_save": Flows.dcp_async_save,
    "ours dcp.async_save": Flows.ours_dcp_native,
    "dcp.async_save + Stager": Flows.dcp_async_save_stager,
    "ours DCP overlapped": Flows.ours_dcp_overlap,
    "ours DCP overlapped+defer": Flows.ours_dcp_overlap_defer,
    "ours torch overlapped": Flows.torch_async_overlap,
    "ours local overlapped": Flows.ours_local_overlap,
    "ours local overlapped+defer": Flows.ours_local_overlap_defer,
}
# CPU only: the reference copy made by several threads, as ours copies.
CPU_FLOWS = {"memcpy threads": Flows.copy_threads}
# CUDA only: torch's "zero-overhead" staging (pinned memory copied on a background thread).
CUDA_FLOWS = {"dcp.async_save overlapped": Flows.dcp_async_save_overlap}


def install_telemetry() -> bool:
    """This rank's OpenTelemetry SDK, as an application configures it, for the
    :data:`TELEMETRY_FLOW` row: spans through a batch processor to an exporter that drops them
    (the export's network is not the trainer's stall), metrics to an in-memory reader. Every
    other flow runs with the library's telemetry suspended. False without the SDK."""
    try:
        from opentelemetry import metrics, trace
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            SpanExporter,
            SpanExportResult,
        )
    except ImportError:
        return False

    class _Dropped(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(_Dropped()))
    trace.set_tracer_provider(provider)
    metrics.set_meter_provider(MeterProvider(metric_readers=[InMemoryMetricReader()]))
    return True
