"""The bandwidth limit of the test kit's proxy: N bytes at rate R take at least N/R, also
when several transfers share it (lower bounds only: a loaded machine may be slower)."""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from resilient_ckpt.errors import ConfigurationError
from resilient_ckpt.testing.fault_proxy import FaultInjectingProxy
from resilient_ckpt.testing.throttle import Throttle

pytestmark = pytest.mark.timeout(60)

RATE = 4e6  # bytes/s
BODY = b"x" * 1_000_000  # 0.25 s at RATE
SLACK = 0.9  # clocks and sleeps may end a hair early; never by a tenth


class _Upstream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)

    def do_PUT(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture
def upstream() -> Iterator[tuple[str, int]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield "127.0.0.1", server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def _request(port: int, method: str, body: bytes | None = None) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, "/bucket/key", body=body)
        response = conn.getresponse()
        assert response.status == 200, response.status
        return response.read()
    finally:
        conn.close()


def test_takes_are_paced_at_the_rate_across_threads() -> None:
    throttle = Throttle(RATE)
    chunks = [64 << 10] * 8  # 512 KiB per thread

    def transfer() -> None:
        for size in chunks:
            throttle.take(size)

    threads = [threading.Thread(target=transfer) for _ in range(3)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    total = 3 * sum(chunks)
    assert throttle.bytes_passed == total
    assert elapsed >= SLACK * total / RATE, elapsed


def test_a_download_through_the_proxy_takes_its_bytes_time(upstream) -> None:
    with FaultInjectingProxy(*upstream, throttle=Throttle(RATE)) as proxy:
        started = time.monotonic()
        assert _request(proxy.port, "GET") == BODY
        elapsed = time.monotonic() - started
    assert elapsed >= SLACK * len(BODY) / RATE, elapsed


def test_concurrent_transfers_share_the_limit(upstream) -> None:
    """Two downloads and an upload through one node's proxy pass its rate together."""
    throttle = Throttle(RATE)
    with FaultInjectingProxy(*upstream, throttle=throttle) as proxy:
        calls = [("GET", None), ("GET", None), ("PUT", BODY)]
        threads = [threading.Thread(target=_request, args=(proxy.port, *c)) for c in calls]
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - started
    assert throttle.bytes_passed >= 3 * len(BODY)
    assert elapsed >= SLACK * 3 * len(BODY) / RATE, elapsed


def test_a_rate_must_be_positive() -> None:
    with pytest.raises(ConfigurationError, match="rate"):
        Throttle(0)
    with pytest.raises(ConfigurationError, match="rate"):
        Throttle(-5.0)
