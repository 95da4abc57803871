"""``AsyncRequest``: what to run in the background and what to run after, on every rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from .. import _dist
from ..errors import FrozenRequestError, InvalidRequestError


class AsyncRequest(NamedTuple):
    """A unit of background work and its finalization (NVRx-compatible field order).

    Args:
        async_fn: run in the background (worker process); ``None`` is a no-op.
        async_fn_args: positional arguments of ``async_fn``.
        finalize_fns: run in the trainer, in order, once ``async_fn`` is done on all ranks.
        async_fn_kwargs: keyword arguments of ``async_fn``.
        preload_fn: zero-argument callable run in the background before ``async_fn``; its
            return value replaces ``async_fn_args[1]`` (by convention, the state dict).
        is_frozen: once frozen (on scheduling), finalize functions can't be added.
        call_idx: set by the queue; orders requests across ranks.
    """

    async_fn: Callable[..., Any] | None
    async_fn_args: tuple | list
    finalize_fns: list[Callable[[], Any]]
    async_fn_kwargs: dict | None = None
    preload_fn: Callable[[], Any] | None = None
    is_frozen: bool = False
    call_idx: int = 0

    def add_finalize_fn(self, fn: Callable[[], Any]) -> None:
        """Append ``fn`` to the finalize functions (runs after the existing ones)."""
        if self.is_frozen:
            raise FrozenRequestError(
                "cannot add a finalize function to a frozen AsyncRequest (it was already "
                "scheduled); add finalize functions before schedule_async_request"
            )
        if not callable(fn):
            raise InvalidRequestError(f"finalize function must be callable, got {fn!r}")
        self.finalize_fns.append(fn)

    def freeze(self) -> AsyncRequest:
        """A copy of this request with ``is_frozen=True``."""
        return self._replace(is_frozen=True)

    def execute_sync(self) -> None:
        """Run the request synchronously in this process: preload, write, barrier, finalize."""
        validate_request(self)
        args = list(self.async_fn_args)
        if self.preload_fn is not None:
            args[1] = checked_preload(self.preload_fn)
        if self.async_fn is not None:
            self.async_fn(*args, **(self.async_fn_kwargs or {}))
        _dist.barrier()
        self.execute_finalize_fns(validate_matching_call_idx=False)

    def execute_finalize_fns(self, validate_matching_call_idx: bool = True) -> int:
        """Run the finalize functions; optionally check every rank finalizes this call_idx."""
        for fn in self.finalize_fns:
            fn()
        if validate_matching_call_idx:
            highest = _dist.max_int(self.call_idx)
            if highest != self.call_idx:
                raise InvalidRequestError(
                    f"rank {_dist.rank()} finalized async call {self.call_idx} while "
                    f"another rank finalized call {highest}: every rank must schedule and "
                    "finalize the same requests in the same order"
                )
        return self.call_idx


def checked_preload(preload_fn: Callable[[], Any]) -> Any:
    replacement = preload_fn()
    if replacement is None:
        raise InvalidRequestError(
            "preload_fn returned None; it must return the replacement for async_fn_args[1] "
            "(the state dict to write)"
        )
    return replacement


def validate_request(request: Any) -> AsyncRequest:
    """Check a request's fields before anything runs; upgrade look-alike tuples."""
    if not isinstance(request, AsyncRequest):
        fields = getattr(request, "_asdict", None)
        if fields is None:
            raise InvalidRequestError(f"expected an AsyncRequest, got {type(request).__name__}")
        request = AsyncRequest(**{k: v for k, v in fields().items() if k in AsyncRequest._fields})
    if request.async_fn is not None and not callable(request.async_fn):
        raise InvalidRequestError(
            f"AsyncRequest.async_fn must be callable or None, got {request.async_fn!r}"
        )
    if not isinstance(request.async_fn_args, (tuple, list)):
        raise InvalidRequestError(
            "AsyncRequest.async_fn_args must be a tuple of positional arguments, got "
            f"{type(request.async_fn_args).__name__}"
        )
    if request.async_fn_kwargs is not None and not isinstance(request.async_fn_kwargs, dict):
        raise InvalidRequestError(
            "AsyncRequest.async_fn_kwargs must be a dict or None, got "
            f"{type(request.async_fn_kwargs).__name__}"
        )
    if not isinstance(request.finalize_fns, (list, tuple)) or not all(
        callable(f) for f in request.finalize_fns
    ):
        raise InvalidRequestError("AsyncRequest.finalize_fns must be a list of callables")
    if request.preload_fn is not None:
        if not callable(request.preload_fn):
            raise InvalidRequestError(
                f"AsyncRequest.preload_fn must be callable or None, got {request.preload_fn!r}"
            )
        if len(request.async_fn_args) < 2:
            raise InvalidRequestError(
                "AsyncRequest.preload_fn's result replaces async_fn_args[1], but async_fn_args "
                f"has only {len(request.async_fn_args)} element(s)"
            )
    return request
