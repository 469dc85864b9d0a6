"""The sidecar's HTTP endpoints: GET /metrics, /healthz, /api/v1/failures. Nothing changes state.

Bounded: at most ``MAX_CONNECTIONS`` handled at once (more are closed at once),
a socket timeout against slow clients and a deadline for a whole request head
(a client dribbling a byte at a time — slowloris — would otherwise hold a
connection slot for as long as it likes), request lines and headers capped by
``http.server``, and at most ``MAX_FAILURES`` reports per response.
"""

from __future__ import annotations

import gzip
import io
import itertools
import json
import socket
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from kvobs.sidecar.ingest import Ingest
from kvobs.sidecar.metrics import KvobsCollector
from kvobs.wire import iter_reports

MAX_CONNECTIONS = 32
SOCKET_TIMEOUT_S = 10.0
REQUEST_DEADLINE_S = 10.0
"""From the start of waiting for a request to the end of its headers (idle keep-alive included)."""
MAX_FAILURES = 1_000
DEFAULT_FAILURES = 100


def _accepts_gzip(header: str) -> bool:
    """Whether an Accept-Encoding header takes gzip (and does not refuse it with q=0)."""
    for part in header.split(","):
        name, _, params = part.strip().partition(";")
        if name.strip().lower() == "gzip":
            q = params.strip().lower()
            return not (q.startswith("q=") and q[2:].strip() in ("0", "0.0", "0.00", "0.000"))
    return False


def recent_failures(failures_dir: Path, limit: int) -> list[dict[str, Any]]:
    """Failure reports, newest first."""
    return list(itertools.islice(iter_reports(failures_dir), limit))


class SidecarServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # listen backlog (socketserver's 5 drops SYNs under a burst: 1 s client retries)

    def __init__(self, address: tuple[str, int], ingest: Ingest) -> None:
        self.ingest = ingest
        self.collector = KvobsCollector(ingest)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.started = time.time()
        super().__init__(address, Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)  # over the bound: refuse rather than queue
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class _DeadlineReader(io.RawIOBase):
    """Socket reads that time out when the handler's current request deadline has passed."""

    def __init__(self, sock: socket.socket, handler: Handler) -> None:
        self._sock = sock
        self._handler = handler

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        remaining = self._handler.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("request head not received within the deadline")
        self._sock.settimeout(min(remaining, SOCKET_TIMEOUT_S))
        return self._sock.recv_into(buffer)


class Handler(BaseHTTPRequestHandler):
    server: SidecarServer
    timeout = SOCKET_TIMEOUT_S
    protocol_version = "HTTP/1.1"
    server_version = "kvobs"
    deadline = 0.0

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the plain makefile() reader: release its reference on the socket
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, self))

    def handle_one_request(self) -> None:
        self.deadline = time.monotonic() + REQUEST_DEADLINE_S
        super().handle_one_request()  # a TimeoutError there closes the connection

    def parse_request(self) -> bool:
        parsed = super().parse_request()  # reads the headers, under the deadline
        self.connection.settimeout(self.timeout)  # the response is written with the normal timeout
        return parsed

    def log_message(self, format: str, *args: Any) -> None:  # quiet: Prometheus scrapes often
        return

    def _send(self, status: int, body: bytes, content_type: str, gzipped: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        if gzipped:
            self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, payload: Any) -> None:
        self._send(status, json.dumps(payload, indent=1).encode(), "application/json")

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path == "/metrics":
            encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
            body = encoder(self.server.registry)
            gzipped = _accepts_gzip(self.headers.get("Accept-Encoding", ""))
            self._send(HTTPStatus.OK, gzip.compress(body, compresslevel=5) if gzipped else body, content_type, gzipped)
        elif url.path == "/healthz":
            ingest = self.server.ingest
            with ingest.lock:
                engines = len(ingest.state.engines)
            age = time.time() - ingest.last_poll if ingest.last_poll else None
            healthy = age is not None and age < 30
            self._json(
                HTTPStatus.OK if healthy else HTTPStatus.SERVICE_UNAVAILABLE,
                {"status": "ok" if healthy else "ingest stalled", "engines": engines, "last_ingest_age_s": age},
            )
        elif url.path == "/api/v1/failures":
            query = parse_qs(url.query)
            try:
                limit = int(query.get("limit", [DEFAULT_FAILURES])[0])
                if not 1 <= limit <= MAX_FAILURES:
                    raise ValueError
            except ValueError:
                self._json(HTTPStatus.BAD_REQUEST, {"error": f"limit must be an integer in [1, {MAX_FAILURES}]"})
                return
            failures = recent_failures(self.server.ingest.dir / "failures", limit)
            self._json(HTTPStatus.OK, {"failures": failures})
        elif url.path == "/":
            self._json(HTTPStatus.OK, {"endpoints": ["/metrics", "/healthz", "/api/v1/failures"]})
        else:
            self._json(HTTPStatus.NOT_FOUND, {"error": f"no such endpoint: {url.path[:200]}"})

    def do_HEAD(self) -> None:
        self.do_GET()

    def _refuse(self) -> None:
        self.send_response(HTTPStatus.METHOD_NOT_ALLOWED)
        self.send_header("Allow", "GET, HEAD")
        self.send_header("Content-Length", "0")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = _refuse


class ListenError(OSError):
    """The sidecar cannot bind its address."""


def serve(directory: Path, host: str = "127.0.0.1", port: int = 9464) -> None:
    """Run ingest and HTTP until interrupted; checkpoint on the way out.

    ``FileNotFoundError`` if ``directory`` does not exist (a mistyped path must not look
    healthy), :class:`ListenError` if the address cannot be bound.
    """
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} is not a directory")
    ingest = Ingest(directory)
    try:
        server = SidecarServer((host, port), ingest)
    except OSError as exc:
        raise ListenError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    ingest.poll()
    worker = threading.Thread(target=ingest.run, name="kvobs-ingest", daemon=True)
    worker.start()
    try:
        server.serve_forever(poll_interval=0.5)
    finally:
        server.server_close()
        ingest.stop()
        worker.join(timeout=10)
