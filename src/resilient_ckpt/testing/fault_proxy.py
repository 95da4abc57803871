"""A fault-injecting HTTP proxy on loopback, for testing object-store retries for real.

Put it between a client and an S3-compatible server (point the client's endpoint at the
proxy): every request is forwarded unchanged, except the ones an armed *fault plan*
selects, which get an HTTP 503 ``ServiceUnavailable`` answer or have their connection reset
(TCP RST, no answer), exactly what a client sees from an overloaded or flaky service.

Why a proxy and not a patched client: the code under test (boto3 via multi-storage-client,
our retry layer) runs unmodified, in any process, over real sockets. The proxy only listens
on 127.0.0.1, forwards only to the upstream it was given, and serves until ``close()``.

    with FaultInjectingProxy("127.0.0.1", server_port) as proxy:
        proxy.arm("503", count=3, match=lambda method, path: method == "PUT")
        ...  # the first 3 PUTs through proxy.endpoint fail with 503
        injected = proxy.injected  # 3 once they have been sent

Several plans can be armed at once; a request takes the fault of the first plan that
selects it. A plan given several modes cycles through them (``("503", "reset")``).

A proxy can also limit bandwidth: with ``throttle=Throttle(rate)`` (:mod:`.throttle`) the
bodies of every request and every answer through it pass at most ``rate`` bytes per second
together. One proxy per simulated node, each with its own throttle, models the ranks of a
node sharing that node's link to the storage service.
"""

from __future__ import annotations

import http.client
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ..errors import ConfigurationError
from .throttle import Throttle

__all__ = ["FaultInjectingProxy", "FaultPlan", "Throttle"]

Match = Callable[[str, str], bool]
MODES = ("503", "reset")
# Hop-by-hop headers (RFC 9110, 7.6.1) and ones the proxy recomputes.
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "expect",
    "content-length",
}
_ERROR_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>ServiceUnavailable</Code>'
    b"<Message>injected by resilient_ckpt.testing.FaultInjectingProxy</Message></Error>"
)


@dataclass
class FaultPlan:
    """Fail the next ``count`` matching requests (every matching one when ``count`` is None),
    with ``modes`` in turn."""

    modes: tuple[str, ...]
    count: int | None
    match: Match | None = None
    injected: int = 0

    def __post_init__(self) -> None:
        if not self.modes or any(mode not in MODES for mode in self.modes):
            raise ConfigurationError(f"fault modes must be among {MODES}, got {self.modes!r}")
        if self.count is not None and self.count < 0:
            raise ConfigurationError(f"fault count must be >= 0 or None, got {self.count}")

    def take(self, method: str, path: str) -> str | None:
        if self.count is not None and self.injected >= self.count:
            return None
        if self.match is not None and not self.match(method, path):
            return None
        self.injected += 1
        return self.modes[(self.injected - 1) % len(self.modes)]


@dataclass
class _State:
    upstream: tuple[str, int]
    throttle: Throttle | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    plans: list[FaultPlan] = field(default_factory=list)
    injected: int = 0
    log: list[tuple[str, str, str]] = field(default_factory=list)

    def decide(self, method: str, path: str) -> str | None:
        with self.lock:
            fault = None
            for plan in self.plans:
                fault = plan.take(method, path)
                if fault is not None:
                    break
            self.injected += fault is not None
            self.log.append((method, path, fault or "forwarded"))
            return fault


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Any

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks: list[bytes] = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _handle(self) -> None:
        state: _State = self.server.state
        body = self._body()
        if state.throttle is not None:
            for _ in state.throttle.chunks(body):  # the upload crosses the node's link
                pass
        fault = state.decide(self.command, self.path)
        if fault == "reset":
            # SO_LINGER with a zero timeout makes close() send RST: a dropped connection.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            return
        if fault == "503":
            self._reply(503, [("Content-Type", "application/xml")], _ERROR_BODY)
            return
        self._forward(state.upstream, body)

    def _forward(self, upstream: tuple[str, int], body: bytes) -> None:
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        headers["Content-Length"] = str(len(body))
        conn = http.client.HTTPConnection(*upstream, timeout=60)
        try:
            conn.request(self.command, self.path, body=body, headers=headers)
            response = conn.getresponse()
            payload = response.read()
            out = [(k, v) for k, v in response.getheaders() if k.lower() not in _HOP_BY_HOP]
            if self.command == "HEAD":
                length = response.getheader("Content-Length")
                self._reply(response.status, out, b"", head_length=length)
            else:
                self._reply(response.status, out, payload)
        finally:
            conn.close()

    def _reply(
        self,
        status: int,
        headers: list[tuple[str, str]],
        body: bytes,
        head_length: str | None = None,
    ) -> None:
        self.send_response_only(status)
        for key, value in headers:
            self.send_header(key, value)
        self.send_header("Content-Length", head_length or str(len(body)))
        self.end_headers()
        throttle: Throttle | None = self.server.state.throttle
        if throttle is None:
            if body:
                self.wfile.write(body)
            return
        for chunk in throttle.chunks(body):
            self.wfile.write(chunk)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle


class FaultInjectingProxy:
    """HTTP proxy on ``127.0.0.1`` in front of ``upstream_host:upstream_port``; with
    ``throttle``, request and answer bodies pass at most at its rate (see the module doc)."""

    def __init__(
        self, upstream_host: str, upstream_port: int, throttle: Throttle | None = None
    ) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        state = _State((upstream_host, upstream_port), throttle)
        self._server.state = state  # type: ignore[attr-defined]
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="resilient_ckpt-fault-proxy",
            daemon=True,
        )
        self._thread.start()

    @property
    def _state(self) -> _State:
        return self._server.state  # type: ignore[attr-defined,no-any-return]

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def arm(
        self, mode: str | Sequence[str], count: int | None, match: Match | None = None
    ) -> FaultPlan:
        """Fail the next ``count`` requests for which ``match(method, path)`` holds (all
        requests without ``match``; every matching one for good with ``count=None``)."""
        plan = FaultPlan((mode,) if isinstance(mode, str) else tuple(mode), count, match)
        with self._state.lock:
            self._state.plans.append(plan)
        return plan

    def disarm(self) -> None:
        with self._state.lock:
            self._state.plans.clear()

    @property
    def injected(self) -> int:
        """Faults injected since the proxy started."""
        with self._state.lock:
            return self._state.injected

    def requests(self) -> list[tuple[str, str, str]]:
        """``(method, path, outcome)`` of every request so far (outcome: a mode or
        ``"forwarded"``)."""
        with self._state.lock:
            return list(self._state.log)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> FaultInjectingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
