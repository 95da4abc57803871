"""Deferred planning: a save planned where its request is staged, not in the save call.

Decision: with a save's structure unchanged since the last one, what its call decides is
almost always "the cached plan still holds": a walk over the state (cache-cold after a
training step) and an all-gather of a few integers (a round trip on a loaded node). With
``defer_planning=True`` (opt-in, every rank alike) that decision, and the payload it leads
to, move out of the call into the staging of the request: in overlapped staging
(``schedule_async_request(..., overlap_staging=True)``) that is the background staging
thread, so the save call returns after building a few objects. Two flows offer it:

* async DCP, ``save_state_dict_async_plan(..., enable_cache=True, defer_planning=True)``:
  from the second save on, the steady-state check and, if any rank's structure changed, a
  full re-plan. The call returns the coordinator's global metadata as a placeholder that
  the planning fills in place; finalize, after the snapshot was waited for, reads the real
  one. The writer's payload (``args[1]``) is the :class:`DeferredList` of write buckets.
* local checkpoints, ``LocalCheckpointManager(..., defer_planning=True)``: an async save
  without a replication strategy checks the iteration and lays the shard out (cached) at
  staging, agreed across ranks there; the request's sources are the deferred list.

Nothing is assumed: the staging runs the very same planning as the call would, only later
and on another thread. Its collectives therefore run on the library's *background* gloo
group (:func:`resilient_ckpt._dist.background_group`), never on a group the trainer's
thread uses, so they cannot interleave with the trainer's own collectives; and it always
runs on the one staging thread of the process (:func:`._staging.in_staging_order`), so
the deferred saves of every queue plan in the order they were staged, on every rank.

What the caller gives up: errors of planning (a state dict that cannot be saved, an
iteration that is not newer, a directory that cannot be set up) are raised where the
request is staged, by ``schedule_async_request`` or, overlapped, by ``wait_for_snapshot``,
on every rank alike; and the state's structure (its containers and keys, not only its
tensors) must stay as it was until then, as overlapped staging already requires of the
values.

The persistent queue completes a request's deferred positional arguments before pickling
it (:func:`resolve_deferred`); a ``preload_fn`` that receives one completes it itself (the
fork queue and ``execute_sync`` run it in the trainer); pickled incomplete, it refuses.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ..errors import InvalidRequestError
from ._staging import in_staging_order


class DeferredArgument:
    """An argument of an ``AsyncRequest`` completed where the request is staged (in
    overlapped staging, on the staging thread): :meth:`resolve` completes it in place, once;
    later calls return it as it is."""

    def resolve(self) -> Any:
        raise NotImplementedError


def resolve_deferred(args: tuple | list) -> None:
    """Complete the request's deferred positional arguments, before it is pickled."""
    for arg in args:
        if isinstance(arg, DeferredArgument):
            arg.resolve()


class DeferredList(list, DeferredArgument):
    """A list that stays empty until :meth:`resolve` plans the save that fills it.

    ``complete`` plans the save and fills this list (through :meth:`fill`). It runs once:
    a failure is kept and raised again by every later call, since running the planning's
    collectives again on one rank alone would leave it waiting for the others.
    """

    def __init__(self, complete: Callable[[], None], what: str) -> None:
        super().__init__()
        self._complete: Callable[[], None] | None = complete
        self._what = what
        self._filled = False
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def fill(self, items: list) -> None:
        """The planned contents (called while :meth:`resolve` runs)."""
        self[:] = items
        self._filled = True

    def resolve(self) -> DeferredList:
        if self._filled:
            return self
        return in_staging_order(self._resolve_here)

    def _resolve_here(self) -> DeferredList:
        with self._lock:
            if self._error is not None:
                raise InvalidRequestError(
                    f"the deferred planning of {self._what} failed before: {self._error}"
                ) from self._error
            complete, self._complete = self._complete, None
            if complete is not None:
                try:
                    complete()
                except BaseException as exc:
                    self._error = exc
                    raise
                if not self._filled:
                    self._error = InvalidRequestError(f"the planning of {self._what} gave nothing")
                    raise self._error
        return self

    @property
    def resolved(self) -> bool:
        return self._filled

    def __reduce_ex__(self, protocol: Any) -> Any:
        if not self._filled:
            raise InvalidRequestError(
                f"{self._what} was made with defer_planning=True and is not planned yet: "
                "schedule its request on an AsyncCallsQueue (its staging plans it) or call "
                "the request's preload_fn first"
            )
        return list, (list(self),)


def resolved(value: Any) -> Any:
    """``value``, completed first if it is a deferred argument (for ``preload_fn``s)."""
    if isinstance(value, DeferredArgument):
        value.resolve()
    return value
