"""The typed messages between the trainer and its persistent worker, and the channel they
travel on.

* **Typed messages over one connection** (a Unix socket pair): each message is one of the
  frozen dataclasses below, sent as ``(Kind, body)``; the receiver checks the kind against
  the body's type, so a protocol mix-up fails loudly. A worker exception travels back as a
  :class:`RemoteFailure` value (which always pickles) and is re-raised as the cause. Arena
  file descriptors follow :class:`AttachArena` out of band (``SCM_RIGHTS``), never pickled.
* **Where a staged storage lies** (:data:`Slot`, :class:`SlotTable`) is part of the
  protocol, not of staging: the trainer's staging writes slots, the worker reads them, and
  both import this module, which imports neither.

The two ends: :mod:`._persistent` (the trainer) and :mod:`._worker` (the worker process).
Each side reads the connection on one receiver thread that blocks on it; on the trainer's
side a request's ``Report`` messages and its ``Result`` go to the caller's mailbox
(:mod:`._reports`) in the order they were sent, so the result of a request is read after
all of its reports.

Conversation::

    trainer -> worker    sys.path         once, to the bootstrap (a plain list of strings)
    trainer -> worker    Setup            once, before anything else of the protocol
    worker  -> trainer   Hello            once, after start-up (the handshake)
    trainer -> worker    AttachArena+fd   once per staging arena the worker has not seen
    trainer -> worker    Submit           one per request, in call order
    worker  -> trainer   Report           any number, while a request runs (naming it)
    worker  -> trainer   Result           one per Submit, in the same order
    trainer -> worker    DetachArena      when the trainer frees an arena
    trainer -> worker    Shutdown         orderly exit after the queued requests
"""

from __future__ import annotations

import array
import enum
import itertools
import os
import socket
import threading
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, ClassVar

from .._logging import get_logger
from ..errors import CheckpointingException
from ._main_module import MainModule

logger = get_logger(__name__)


class Kind(enum.Enum):
    SETUP = "setup"
    HELLO = "hello"
    ATTACH_ARENA = "attach_arena"
    DETACH_ARENA = "detach_arena"
    SUBMIT = "submit"
    RESULT = "result"
    REPORT = "report"
    SHUTDOWN = "shutdown"


@dataclass(frozen=True)
class Setup:
    """How the worker runs: what a spawned process would inherit besides its environment
    (``is_daemon`` as ``multiprocessing``'s flag: a daemon process starts no children)."""

    KIND: ClassVar[Kind] = Kind.SETUP
    parent_pid: int
    rank: int | None
    log_level: int
    cpu_priority: int | None
    io_priority: int | None
    is_daemon: bool
    name: str
    argv: tuple[str, ...]
    main_module: MainModule
    # The trainer's multiprocessing key: a manager's proxy in a request connects with it.
    authkey: bytes
    # NVRx's ``otel_bootstrap``: how the worker configures its telemetry (:mod:`.._telemetry`).
    otel_bootstrap: dict[str, Any] | None = None


@dataclass(frozen=True)
class Hello:
    KIND: ClassVar[Kind] = Kind.HELLO
    pid: int


@dataclass(frozen=True)
class AttachArena:
    KIND: ClassVar[Kind] = Kind.ATTACH_ARENA
    arena_id: int
    nbytes: int


@dataclass(frozen=True)
class DetachArena:
    KIND: ClassVar[Kind] = Kind.DETACH_ARENA
    arena_id: int


# Where one staged storage lies inside an arena: (offset, nbytes). A plain tuple, not a
# dataclass: a request has one per storage (thousands), and the C pickler writes plain
# tuples of ints without a Python call each.
Slot = tuple[int, int]


def _unpack_slots(packed: bytes) -> tuple[Slot, ...]:
    words = array.array("q")
    words.frombytes(packed)
    return tuple(zip(words[0::2], words[1::2], strict=True))


class SlotTable(tuple[Slot, ...]):
    """A request's slots, pickled as one packed bytes object (two int64 per slot), not thousands of
    small tuples to visit while the trainer waits. A steady-state save resends the table of its
    full staging, so it is packed once. The worker gets a plain tuple back.
    """

    _packed: bytes | None = None

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        packed = self._packed
        if packed is None:
            packed = array.array("q", itertools.chain.from_iterable(self)).tobytes()
            self._packed = packed
        return _unpack_slots, (packed,)


@dataclass(frozen=True)
class Submit:
    KIND: ClassVar[Kind] = Kind.SUBMIT
    call_idx: int
    arena_id: int | None
    slots: tuple[Slot, ...]
    payload: bytes
    # The trainer's save span (W3C ``traceparent``): the worker's spans are its children.
    traceparent: str | None = None


@dataclass(frozen=True)
class RemoteFailure:
    """An exception raised in the worker, as a value that always pickles."""

    exc_type: str
    message: str
    traceback: str

    @classmethod
    def from_exception(cls, exc: BaseException) -> RemoteFailure:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc), text)


@dataclass(frozen=True)
class Result:
    KIND: ClassVar[Kind] = Kind.RESULT
    call_idx: int
    failure: RemoteFailure | None = None
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Report:
    """A value the running request posted for the trainer (:func:`._reports.post`)."""

    KIND: ClassVar[Kind] = Kind.REPORT
    call_idx: int
    key: str
    value: Any


@dataclass(frozen=True)
class Shutdown:
    KIND: ClassVar[Kind] = Kind.SHUTDOWN


Body = Setup | Hello | AttachArena | DetachArena | Submit | Result | Report | Shutdown


class ProtocolError(CheckpointingException):
    """A message arrived that the protocol does not allow at this point."""


# A request's payload for thousands of tensors can exceed the socket's default send buffer;
# the send would then wait for the worker to be scheduled and drain it.
_SEND_BUFFER = 4 << 20


def widen_send_buffer(conn: Connection) -> None:
    """Let ``conn`` queue a whole payload without waiting for its reader (capped by the kernel at
    ``net.core.wmem_max``); best effort.
    """
    try:
        sock = socket.socket(fileno=os.dup(conn.fileno()))
    except OSError:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER)
    except OSError as exc:
        logger.debug("could not widen the worker channel's send buffer: %r", exc)
    finally:
        sock.close()


class Channel:
    """One end of the trainer/worker connection; sends are serialised by a lock."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._send_lock = threading.Lock()

    def send(self, body: Body, fd: int | None = None, peer_pid: int | None = None) -> None:
        from multiprocessing.reduction import send_handle

        with self._send_lock:
            self.conn.send((body.KIND, body))
            if fd is not None:
                send_handle(self.conn, fd, peer_pid or 0)

    def recv(self) -> Body:
        kind, body = self.conn.recv()
        if not isinstance(kind, Kind) or getattr(type(body), "KIND", None) is not kind:
            raise ProtocolError(f"malformed message: kind={kind!r}, body={type(body).__name__}")
        return body  # type: ignore[no-any-return]

    def recv_fd(self) -> int:
        from multiprocessing.reduction import recv_handle

        return recv_handle(self.conn)

    def shut(self) -> None:
        """Wake a thread blocked reading this end: it reads end-of-file (the connection is a
        socket; shutting it down reaches every descriptor of it)."""
        try:
            sock = socket.socket(fileno=os.dup(self.conn.fileno()))
        except OSError:
            return
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            sock.close()

    def close(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass
