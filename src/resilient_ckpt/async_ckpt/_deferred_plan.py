"""A DCP save planned where its request is staged, not in the save call (opt-in).

Decision: with the plan cache warm, what the planning call of a save decides is almost
always "the cached plan still holds": a walk over the state (~1 us a tensor, cache-cold
after a training step) and an all-gather of a few integers (latency, ~0.5 ms on a loaded
node). ``save_state_dict_async_plan(..., defer_planning=True)`` moves that whole decision,
and the write buckets it leads to, out of the call and into the staging of the request:
in overlapped staging (``schedule_async_request(..., overlap_staging=True)``) that is the
background staging thread, so the save call returns after building a few objects.

Nothing is assumed: the staging runs the very same planning as the call would (the
steady-state check, and a full re-plan if any rank's structure changed), only later and on
another thread. Its collectives therefore run on the library's *background* gloo group
(:func:`resilient_ckpt._dist.background_group`), never on a group the trainer's thread
uses, so they cannot interleave with the trainer's own collectives. The call returns the
coordinator's global metadata as a placeholder object that the planning fills in place;
finalize, which runs after the snapshot was waited for, reads the real one.

What the caller gives up: errors of planning (a state dict DCP cannot save, a rank whose
writer failed to set up its directory) are raised where the request is staged, by
``schedule_async_request`` or, overlapped, by ``wait_for_snapshot``, on every rank alike;
and the state's structure (its containers and keys, not only its tensors) must stay as it
was until then, as overlapped staging already requires of the values.

:class:`DeferredBuckets` is the writer's payload meanwhile: an empty list that the planning
fills with the write buckets. The persistent queue completes it before pickling the request
(:func:`resilient_ckpt.async_ckpt._request.resolve_deferred`), the writer's ``preload_fn``
when it is called itself; pickled incomplete, it refuses.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ..errors import InvalidRequestError
from ._request import DeferredArgument


class DeferredBuckets(list, DeferredArgument):
    """A deferred save's write buckets: empty until :meth:`resolve` plans the save.

    ``complete`` plans the save and fills this list (through :meth:`fill`, called by the
    writer's ``prepare_write_data``). It runs once: a failure is kept and raised again by
    every later call, since running the planning's collectives again on one rank alone
    would leave it waiting for the others.
    """

    def __init__(self, complete: Callable[[], None], what: str) -> None:
        super().__init__()
        self._complete: Callable[[], None] | None = complete
        self._what = what
        self._filled = False
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def fill(self, buckets: list) -> None:
        """The planned buckets (from the writer, while :meth:`resolve` runs)."""
        self[:] = buckets
        self._filled = True

    def resolve(self) -> DeferredBuckets:
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
                    self._error = InvalidRequestError("the planning gave no write buckets")
                    raise self._error
        return self

    @property
    def resolved(self) -> bool:
        return self._filled

    def __reduce_ex__(self, protocol: Any) -> Any:
        if not self._filled:
            raise InvalidRequestError(
                f"the write buckets of {self._what} were planned with defer_planning=True and "
                "are not planned yet: schedule the request with an AsyncCallsQueue (its "
                "staging plans them) or call the writer's preload_fn first"
            )
        return list, (list(self),)
