"""Distributed plumbing shared by every layer: the library's group, this rank, agreement.

* **The library's own gloo group**, so our collectives work the same in CPU-only and GPU
  jobs, never touch CUDA and never interleave with the user's NCCL collectives. Creating it
  is collective, so it happens lazily in the first library call every rank makes anyway (a
  finalize, a local save); its timeout is the collective deadline (:mod:`.config`), so a
  vanished rank makes the others fail instead of wait. One group per default group.
* **This rank** is the default group's rank (0 without one), from one function
  (:mod:`._rank`, handed out here), so a log line, a file name and an error never disagree
  about who "I" am.
* **One agreement primitive**, :func:`agree`: a step that may have failed on some ranks
  becomes one outcome on every rank. The successful case is one tensor all-gather (a failure
  flag and a few integers) or one object all-gather (a payload). Only if a rank failed does a
  second all-gather collect each failed rank's error *as text*: exception objects may not
  pickle, their classes may not exist elsewhere. Every rank then raises the same
  :class:`~resilient_ckpt.errors.RankFailureError` (class chosen by :mod:`._rank_errors`)
  naming the failed ranks, instead of the healthy ones timing out in the next collective.
  :func:`run_agreed` (and :func:`gather_agreed`, :func:`run_agreed_int`, which also share
  a value) run a step here and agree its outcome, the form most callers need.
* **The same agreement with a coordinator that acts**, :func:`decide`, for a step whose
  outcome one rank computes from everyone's contributions (a DCP save's global plan, its
  commit). Each rank's error and payload are *gathered* on the coordinator, not all-gathered:
  a finalize's payload is every rank's write results, which only the coordinator reads.
  The coordinator acts when no rank failed, and a failure of its act is its own failure;
  the verdict (the failures, or the act's result, whole or one part per rank) goes back in
  one broadcast or scatter, and every rank raises the error :func:`agree` would raise. This
  replaces torch's ``_DistWrapper`` collectives, which ran on the caller's group (often
  NCCL), carried pickled exception objects (which may not unpickle elsewhere) and raised
  torch's ``CheckpointException``, a ``BaseException``, that each caller had to convert.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ._logging import get_logger
from ._rank import has_process_group, is_distributed, rank, world_size  # noqa: F401
from .config import default_timeouts
from .errors import CheckpointingException, RemoteTraceback, UnsafeCheckpointError

T = TypeVar("T")

logger = get_logger(__name__)

_groups: dict[int, Any] = {}


def library_group(timeout: float | None = None) -> Any:
    """The library's gloo group over all ranks (created on first use, then cached).

    Collective on first use. The first caller's ``timeout`` (default: the configured
    collective deadline) becomes the group's timeout.
    """
    key = id(dist.group.WORLD)
    if key not in _groups:
        _groups.clear()  # a new default group: the old groups are gone with it
    return _gloo_group(key, "library", timeout)


def background_group(timeout: float | None = None) -> Any:
    """A second library gloo group, for collectives off the trainer's thread (a deferred
    save's planning): each thread keeps its collectives in the same order on every rank only
    on a group of its own. Collective on first use."""
    library_group(timeout)  # both exist, created in the same order on every rank
    return _gloo_group(-id(dist.group.WORLD), "library background", timeout)


def _gloo_group(key: int, what: str, timeout: float | None) -> Any:
    """The gloo group cached under ``key``, created (collectively) on first use."""
    group = _groups.get(key)
    if group is None:
        seconds = default_timeouts().collective if timeout is None else timeout
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=seconds))
        _groups[key] = group
        logger.debug("created %s gloo group (timeout %.0fs)", what, seconds)
    return group


def known_group_name(group: Any) -> str | None:
    """``"library"`` or ``"library background"`` if ``group`` is one of ours, else None."""
    for key, found in _groups.items():
        if found is group:
            return "library" if key >= 0 else "library background"
    return None


def is_cpu_group(group: Any) -> bool:
    """Whether tensor collectives on ``group`` run on the CPU (a gloo backend)."""
    return "gloo" in str(dist.get_backend(group)).lower()


def all_gather_object(obj: Any, group: Any = None, timeout: float | None = None) -> list[Any]:
    """``obj`` from every rank of ``group`` (default: the library group), in group order."""
    if group is None and not is_distributed():
        return [obj]
    group = library_group(timeout) if group is None else group
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def max_int(value: int, timeout: float | None = None) -> int:
    """The largest ``value`` over all ranks (library group)."""
    if not is_distributed():
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=library_group(timeout))
    return int(t.item())


def barrier(timeout: float | None = None) -> None:
    """Wait for every rank (library group); nothing without a process group."""
    if is_distributed():
        dist.barrier(group=library_group(timeout))


@dataclass(frozen=True)
class RankFailure:
    """One rank's error as it travels between ranks: text only.

    ``kinds``: the MRO's class names, most derived first (they choose the class every rank
    raises); ``traceback``: where it started, in the worker if it came from there;
    ``exitcode``: set for a dead process; ``path``, ``global_name``: a checkpoint file
    error's ``path`` and refused global ``name``, which every rank's error carries.
    """

    rank: int
    kinds: tuple[str, ...]
    message: str
    traceback: str
    exitcode: int | None = None
    path: str | None = None
    global_name: str | None = None

    @classmethod
    def of(cls, rank: int, exc: BaseException) -> RankFailure:
        cause = exc.__cause__
        if isinstance(cause, RemoteTraceback):
            tb = cause.tb
        else:
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        kinds = tuple(c.__name__ for c in type(exc).__mro__)
        exitcode = getattr(exc, "exitcode", None)
        path = getattr(exc, "path", None) if isinstance(exc, CheckpointingException) else None
        name = getattr(exc, "name", None) if isinstance(exc, UnsafeCheckpointError) else None
        return cls(
            rank,
            kinds,
            f"{type(exc).__name__}: {exc}",
            tb,
            exitcode,
            path if isinstance(path, str) else None,
            name if isinstance(name, str) else None,
        )


@dataclass(frozen=True)
class Outcome:
    """What one rank contributed to an agreement that succeeded everywhere."""

    rank: int
    ints: tuple[int, ...] = ()
    payload: Any = None


def agree(
    what: str,
    error: BaseException | None,
    *,
    ints: Sequence[int] = (),
    payload: Any = None,
    with_payload: bool = False,
    group: Any = None,
    local_only: bool = False,
    timeout: float | None = None,
    details: dict[str, Any] | None = None,
) -> list[Outcome]:
    """Every rank's outcome of ``what``, in group-rank order; raise everywhere on any error.

    Collective over ``group`` (default: the library group); every rank passes the same
    ``what``, number of ``ints`` and ``with_payload``. ``error``: this rank's exception (None:
    success). ``ints`` travel in one tensor all-gather, or with ``with_payload`` the
    ``payload`` objects in one object all-gather. ``local_only``: this rank alone.

    Raises :class:`~resilient_ckpt.errors.RankFailureError` (the subclass matching the
    failures) on every rank if any set ``error``: it names the failed ranks, carries their
    messages and tracebacks and ``details`` as attributes, chained to this rank's ``error`` or
    the first failed rank's remote traceback.
    """
    me = _group_rank(group, local_only)
    mine = RankFailure.of(me, error) if error is not None else None
    values = tuple(int(v) for v in ints)
    if local_only:
        gathered = [(mine, values, payload)]
    elif with_payload or not _tensor_capable(group):
        gathered = all_gather_object((mine, values, payload), group, timeout)
    else:
        gathered = _gather_flags(mine is not None, values, group, timeout)
        if any(failed for failed, _, _ in gathered):
            failures = all_gather_object(mine, group, timeout)
            gathered = [(f, v, None) for f, (_, v, _) in zip(failures, gathered, strict=True)]
    failed = [entry[0] for entry in gathered if entry[0]]
    if failed:
        raise _agreed_error(what, failed, error, me, details or {}) from (
            error if error is not None else _first_remote_traceback(failed)
        )
    if local_only:
        return [Outcome(me, values, payload)]
    return [Outcome(r, tuple(v), p) for r, (_, v, p) in enumerate(gathered)]


def decide(
    what: str,
    error: BaseException | None,
    payload: Any,
    act: Callable[[list[Any]], Any],
    *,
    coordinator: int = 0,
    scatter: bool = False,
    group: Any = None,
    local_only: bool = False,
    timeout: float | None = None,
) -> Any:
    """``act(payloads)``, run on the ``coordinator`` when no rank set ``error``; its result on
    every rank (with ``scatter``, ``act`` returns one result per rank and each rank gets its
    own). Raise everywhere on any error, as :func:`agree` does.

    Collective over ``group`` (default: the library group; ``coordinator`` is a rank of it);
    every rank passes the same ``what``, ``coordinator`` and ``scatter``. ``payload``: what
    this rank gives ``act`` (anything that pickles), ignored when ``error`` is set; the
    coordinator's ``act`` gets every rank's, in group-rank order, and an exception it raises
    is the coordinator's failure. ``local_only``: this rank alone, as its own coordinator.
    One object gather to the coordinator, then one object broadcast or scatter of the verdict.
    """
    me = _group_rank(group, local_only)
    mine = RankFailure.of(me, error) if error is not None else None
    if local_only or (group is None and not is_distributed()):
        verdict, act_error = _verdict([(mine, payload)], act, me, scatter)
        failures, result = verdict[0] if scatter else verdict
    else:
        failures, result, act_error = _decide_on(
            (mine, payload), act, me, coordinator, scatter, group, timeout
        )
    own_error = error if error is not None else act_error
    if failures:
        raise _agreed_error(what, failures, own_error, me, {}) from (
            own_error if own_error is not None else _first_remote_traceback(failures)
        )
    return result


def _decide_on(
    entry: tuple[RankFailure | None, Any],
    act: Callable[[list[Any]], Any],
    me: int,
    coordinator: int,
    scatter: bool,
    group: Any,
    timeout: float | None,
) -> tuple[list[RankFailure], Any, BaseException | None]:
    """:func:`decide` across ranks: ``(failures, result, the act's error here)``."""
    group = library_group(timeout) if group is None else group
    source = dist.get_global_rank(group, coordinator)
    size = dist.get_world_size(group)
    gathered: list[Any] | None = [None] * size if me == coordinator else None
    dist.gather_object(entry, gathered, dst=source, group=group)
    verdict: Any = None
    act_error: BaseException | None = None
    if gathered is not None:
        verdict, act_error = _verdict(gathered, act, me, scatter)
    if scatter:
        mine: list[Any] = [None]
        dist.scatter_object_list(mine, verdict, src=source, group=group)
        failures, result = mine[0]
    else:
        box = [verdict]
        dist.broadcast_object_list(box, src=source, group=group)
        failures, result = box[0]
    return failures, result, act_error


def _verdict(
    gathered: list[tuple[RankFailure | None, Any]],
    act: Callable[[list[Any]], Any],
    me: int,
    scatter: bool,
) -> tuple[Any, BaseException | None]:
    """The coordinator's verdict on ``gathered``: ``(failures, result)``, or with ``scatter``
    one such pair per rank; and the act's exception, if it raised."""
    failures = [failure for failure, _ in gathered if failure is not None]
    result: Any = None
    act_error: BaseException | None = None
    if not failures:
        try:
            result = act([payload for _, payload in gathered])
            if scatter and (not isinstance(result, Sequence) or len(result) != len(gathered)):
                raise CheckpointingException(
                    f"the coordinator's step gave {type(result).__name__} for "
                    f"{len(gathered)} ranks, not one result per rank"
                )
        except Exception as exc:
            act_error = exc
            failures = [RankFailure.of(me, exc)]
    if not scatter:
        return (failures, result), act_error
    if failures:
        return [(failures, None)] * len(gathered), act_error
    return [([], part) for part in result], act_error


def _attempt(step: Callable[[], T]) -> tuple[T | None, Exception | None]:
    """``step()`` here: its value, or the exception :func:`agree` carries to every rank."""
    try:
        return step(), None
    except Exception as exc:
        return None, exc


def run_agreed(what: str, step: Callable[[], T]) -> T:
    """Run ``step`` here; raise on every rank if it failed on any (:func:`agree`).
    Collective, on the library group."""
    value, error = _attempt(step)
    agree(what, error)
    return value  # type: ignore[return-value]


def gather_agreed(what: str, step: Callable[[], T]) -> list[T]:
    """Run ``step`` here; every rank's value, in rank order, in one object all-gather.
    Raises on every rank if ``step`` failed on any. Collective, on the library group."""
    value, error = _attempt(step)
    outcomes = agree(what, error, payload=value, with_payload=True)
    return [o.payload for o in outcomes]


def run_agreed_int(
    what: str, step: Callable[[], T], number: int, group: Any = None
) -> tuple[T, list[int]]:
    """Run ``step`` here; its value and every rank's ``number``, carried in the tensor
    all-gather of the failure flags (no object all-gather, no pickle). On ``group``
    (default: the library group; a deferred save's staging passes the background group)."""
    value, error = _attempt(step)
    shared = number if error is None and isinstance(number, int) else -1
    outcomes = agree(what, error, ints=(shared,), group=group)
    return value, [o.ints[0] for o in outcomes]  # type: ignore[return-value]


def _group_rank(group: Any, local_only: bool) -> int:
    if local_only or group is None:
        return rank()
    return dist.get_rank(group)


def _tensor_capable(group: Any) -> bool:
    return group is None or is_cpu_group(group)


def _gather_flags(
    failed: bool, values: tuple[int, ...], group: Any, timeout: float | None
) -> list[tuple[Any, tuple[int, ...], Any]]:
    """One tensor all-gather of ``[failed, *values]``; ``[(failed, values, None)]`` per rank."""
    if group is None and not is_distributed():
        return [(failed, values, None)]
    group = library_group(timeout) if group is None else group
    mine = torch.tensor([int(failed), *values], dtype=torch.int64)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [(bool(t[0]), tuple(int(v) for v in t[1:].tolist()), None) for t in out]


def _describe(failures: list[RankFailure]) -> str:
    """The failure messages, each once, with the ranks that reported it."""
    by_message: dict[str, list[int]] = {}
    for failure in failures:
        by_message.setdefault(failure.message, []).append(failure.rank)
    if len(by_message) == 1:
        return next(iter(by_message))
    return "; ".join(f"rank(s) {ranks}: {message}" for message, ranks in by_message.items())


def _agreed_error(
    what: str,
    failures: list[RankFailure],
    mine: BaseException | None,
    me: int,
    details: dict[str, Any],
) -> CheckpointingException:
    # Imported here: it needs torch.distributed.checkpoint, which the success path and the
    # background workers never load.
    from ._rank_errors import error_class_for, local_failure, remote_failure

    ranks = [f.rank for f in failures]
    cls = error_class_for([f.kinds for f in failures])
    torch_view = {
        f.rank: local_failure(mine)
        if mine is not None and f.rank == me
        else remote_failure(f.message, f.traceback)
        for f in failures
    }
    error = cls(
        f"{what} failed on rank(s) {ranks}: {_describe(failures)}",
        what=what,
        failed_ranks=ranks,
        tracebacks={f.rank: f.traceback for f in failures},
        failures=torch_view,
    )
    exitcodes = [f.exitcode for f in failures if f.exitcode is not None]
    if exitcodes:
        error.exitcode = exitcodes[0]  # type: ignore[attr-defined]
    about_file = next((f for f in failures if f.path is not None), None)
    if about_file is not None:
        error.path = about_file.path  # type: ignore[attr-defined]
        if about_file.global_name is not None:
            error.name = about_file.global_name  # type: ignore[attr-defined]
    for name, value in details.items():
        setattr(error, name, value)
    return error


def _first_remote_traceback(failures: list[RankFailure]) -> RemoteTraceback | None:
    tb = next((f.traceback for f in failures if f.traceback), None)
    return RemoteTraceback(tb) if tb else None
