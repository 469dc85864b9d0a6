"""The sidecar's HTTP endpoints: GET /metrics, /healthz, /api/v1/failures, /api/v1/replays; one POST,
/api/v1/replays, which asks the engines for replay bundles (kvobs/sidecar/replay_endpoints.py says how). Nothing
else changes state.

``GET /metrics``: Prometheus text, or OpenMetrics when the scraper's ``Accept`` asks for it;
gzip-compressed when its ``Accept-Encoding`` takes gzip (Prometheus's scraper sends that).
``name[]`` (repeatable) keeps only the series it names, as prometheus_client's own exporter does.
/metrics ignores any other parameter (a scrape config may add its own), /healthz and /livez ignore
all: only /api/v1/failures refuses a parameter it does not know.

``GET /healthz``: 200 while the last ingest round is under 30 s old, else 503 (``status`` "first
ingest round running" until the first round ends, which a long journal replay makes minutes; then
"ingest stalled"); either way it lists
what the sidecar cannot read (``cannot_read``: another uid's files read as an empty directory
otherwise, and a blind sidecar must not look healthy to the person who asks: with no engine read
and paths it cannot read, its 200's ``status`` says "reads no engine and cannot read N paths"
instead of "ok"; the code stays 200, /healthz being about ingest, not readiness).

``GET /livez``: 200 whenever the HTTP server answers, from the moment it is bound (the first ingest
round runs in the ingest thread, not before the server starts). Kubernetes's liveness probe reads this, not
/healthz: restarting the sidecar for a slow ingest would not make it read faster, and while a
container restarts its pod is not Ready, which takes vLLM out of its Service.

``GET /api/v1/openapi.json``: the OpenAPI 3 document of every endpoint (kvobs/sidecar/openapi.json), open
like /metrics.

``GET /api/v1/failures/<id>``: one report as the list serves it (404 if there is none of that id); the
sidecar's log line of each failure names it.

``GET /api/v1/failures``: failure reports, newest first, as ``{"failures": [...], "next": URL|null}``.
Each report is the file the engine wrote (every field of the message), plus its ``id`` (the
file's stem; ids sort in write order) and, per group of ``missing_summary.ages``, the histogram's
``bounds`` (upper bounds in seconds, the last ``"+Inf"``) next to its ``counts``. Parameters,
all optional; ``engine``, ``model_name`` and ``cause`` may repeat (any of the values matches):

* ``limit``: reports per page, 1..``MAX_FAILURES`` (default ``DEFAULT_FAILURES``);
* ``engine``: the ``engine`` label;
* ``model_name``: the served model (``model_name=`` with no value: reports without one);
* ``cause``: one of ``kvobs.codes.CAUSES`` (anything else: 400 naming it);
* ``since``: unix seconds (a float); reports at or after it;
* ``before``: a report ``id``; reports older than it (the paging cursor).

With a bearer token (``kvobs serve --token-file``), /api/v1/failures and /api/v1/replays answer 401 to
a request without ``Authorization: Bearer <token>``: the reports and bundles carry request ids. /metrics, /healthz and
/livez stay open to the scraper and the kubelet.

``next`` is the relative URL of the next page (the same filters, ``before`` the last id
served), or null when no more reports match. Follow it until it is null: a page can hold fewer
than ``limit`` reports when the request read ``MAX_SCANNED`` report files or ``MAX_PAGE_BYTES``
of them first (each request's work is bounded: kvobs/sidecar/failures.py). Every parameter is checked by its rule
(``kvobs.sidecar.query``): an unknown one or a bad value is a 400 whose ``parameter`` names it.
Example: ``GET /api/v1/failures?engine=dp0&cause=evicted_after_lookup&since=1767225600&limit=50``.

Bounded: at most ``MAX_CONNECTIONS`` handled at once (more are closed at once),
a socket timeout against slow clients and a deadline for a whole request head
(a client dribbling a byte at a time — slowloris — would otherwise hold a
connection slot for as long as it likes), request lines and headers capped by
``http.server``, and at most ``MAX_FAILURES`` reports per response.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import hmac
import io
import json
import logging
import math
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import SplitResult, parse_qs, urlsplit

from prometheus_client import CollectorRegistry, GCCollector, Metric, PlatformCollector, ProcessCollector
from prometheus_client.exposition import choose_encoder

from kvobs.replay_requests import TooSoon
from kvobs.sidecar import replay_endpoints
from kvobs.sidecar.failures import FailureQuery, failure_page, one_report
from kvobs.sidecar.ingest import Ingest
from kvobs.sidecar.metrics import KvobsCollector
from kvobs.sidecar.query import FAILURES_PATH, QueryError
from kvobs.sidecar.replay_endpoints import REPLAYS_PATH
from kvobs.wire.format import FAILURES_DIR

logger = logging.getLogger("kvobs.sidecar")

MAX_CONNECTIONS = 32
SOCKET_TIMEOUT_S = 10.0
MAX_POST_BODY = 1024
"""The body POST /api/v1/replays reads (and ignores) at most; a larger one is refused unread (413)."""
REQUEST_DEADLINE_S = 10.0
"""From the start of waiting for a request to the end of its headers (idle keep-alive included)."""


def _accepts_gzip(header: str) -> bool:
    """Whether an Accept-Encoding header takes gzip (and does not refuse it with q=0)."""
    for part in header.split(","):
        name, _, params = part.strip().partition(";")
        if name.strip().lower() == "gzip":
            q = params.strip().lower()
            return not (q.startswith("q=") and q[2:].strip() in ("0", "0.0", "0.00", "0.000"))
    return False


class _Named:
    """A registry's series whose sample names ``name[]`` lists, as prometheus_client's own exporter
    filters (scrape configs rely on it); written here because its ``restricted_registry`` leaves out a
    collector that does not describe its series, as ours does not (the registry has no auto-describe)."""

    def __init__(self, registry: CollectorRegistry, names: list[str]) -> None:
        self.registry, self.names = registry, set(names)

    def collect(self) -> Iterator[Metric]:
        for metric in self.registry.collect():
            samples = [sample for sample in metric.samples if sample.name in self.names]
            if samples:
                kept = Metric(metric.name, metric.documentation, metric.type, metric.unit)
                kept.samples = samples
                yield kept


def _restricted(registry: CollectorRegistry, query: str) -> Any:
    """The registry, or only the series ``name[]`` names. Any other parameter is ignored (a scrape
    config may add its own)."""
    names = parse_qs(query).get("name[]")
    return _Named(registry, names) if names else registry


HEALTHZ_UNREADABLE = 20
"""Paths /healthz names at most (``unreadable_files`` counts them all)."""
OPENAPI_PATH = "/api/v1/openapi.json"
"""The OpenAPI 3 document of every endpoint (kvobs/sidecar/openapi.json; tests/integration/test_openapi.py checks
the running server against it with schemathesis)."""


@functools.cache
def openapi_document() -> bytes:
    """kvobs/sidecar/openapi.json (package data), its ``info.version`` this kvobs's."""
    from kvobs import __version__

    document = json.loads(resources.files("kvobs.sidecar").joinpath("openapi.json").read_bytes())
    document["info"]["version"] = __version__
    return json.dumps(document, indent=1).encode()


def listen_address(host: str, port: int) -> tuple[socket.AddressFamily, tuple[Any, ...]]:
    """The socket family and address to bind ``host`` (an IPv4 or IPv6 address, ``[v6]``, or a name).

    ``::`` binds IPv6 and, where the kernel allows (``IPV6_V6ONLY`` off, see ``server_bind``),
    IPv4 too: one socket for a dual-stack pod. OSError if the name does not resolve."""
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    return family, address


def http_url(host: str, port: int, path: str) -> str:
    """``http://host:port/path`` with an IPv6 address in brackets."""
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return f"http://{f'[{host}]' if ':' in host else host}:{port}{path}"


class SidecarServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # listen backlog (socketserver's 5 drops SYNs under a burst: 1 s client retries)

    def __init__(self, address: tuple[str, int], ingest: Ingest, token: bytes | None = None) -> None:
        self.ingest = ingest
        self.token = token
        self.replay_requests = replay_endpoints.Tracker(ingest)
        """Follows each replay request to its answer (kvobs/sidecar/replay_endpoints.py); swept by ``serve``'s
        thread."""
        self.collector = KvobsCollector(ingest)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        # The standard process_* (CPU, memory, open files) and python_* series of every prometheus_client
        # exporter, on this registry: the sidecar's own resource use next to its kvobs_sidecar_* series.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.started = time.time()
        self.address_family, bind_to = listen_address(*address)
        super().__init__(bind_to, Handler)

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6:  # "::" also takes IPv4 (dual stack) where allowed
            with contextlib.suppress(OSError):
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()

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

    def handle_error(self, request: Any, client_address: Any) -> None:
        """What a request's handling raised, through kvobs's logger (so ``--log-format json`` holds: never
        socketserver's raw traceback on standard error). A client gone mid-response (a scraper's timeout, a
        dropped bundle download) is not the sidecar's fault: said at debug level; anything else at error,
        its traceback in the line (kvobs/sidecar/log_format.py's ``exception`` field)."""
        exc = sys.exc_info()[1]
        client = client_address[0] if isinstance(client_address, tuple) and client_address else client_address
        if isinstance(exc, ConnectionError | TimeoutError):  # broken pipe, reset, aborted; a stalled client
            logger.debug("kvobs sidecar: client %s went away mid-response: %r", client, exc)
            return
        logger.error("kvobs sidecar: a request from %s failed: %r", client, exc, exc_info=exc is not None)


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

    def _send(self, status: int, body: bytes, content_type: str, gzipped: bool = False,
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        if gzipped:
            self.send_header("Content-Encoding", "gzip")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(payload, indent=1).encode(), "application/json", headers=headers)

    def _target(self) -> SplitResult | None:
        """The request's target, split; None, with a 400 sent, when it does not split (``//[x``: an
        unclosed IPv6 host; tests/fuzz/crashes/sidecar/)."""
        try:
            return urlsplit(self.path)
        except ValueError as exc:
            self._json(HTTPStatus.BAD_REQUEST, {"error": f"the request target does not parse: {exc}"})
            return None

    def do_GET(self) -> None:
        url = self._target()
        if url is None:
            return
        if url.path == "/metrics":
            try:
                encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
            except (TypeError, ValueError):  # a version it cannot compare ("version=1.0.0c"; tests/fuzz/crashes/)
                encoder, content_type = choose_encoder("")  # the Prometheus text every scraper reads
            body = encoder(_restricted(self.server.registry, url.query))
            gzipped = _accepts_gzip(self.headers.get("Accept-Encoding", ""))
            self._send(HTTPStatus.OK, gzip.compress(body, compresslevel=5) if gzipped else body, content_type, gzipped)
        elif url.path == "/healthz":
            ingest = self.server.ingest
            with ingest.lock:
                engines = len(ingest.state.engines)
                unreadable = sorted(ingest.unreadable.items())
            age = time.time() - ingest.last_poll if ingest.last_poll else None
            healthy = age is not None and age < 30
            if healthy and engines == 0 and unreadable:  # reading, but blind: not "ok", though still 200
                paths = f"{len(unreadable)} path{'s' * (len(unreadable) != 1)}"
                status = f"reads no engine and cannot read {paths} (cannot_read)"
            elif healthy:
                status = "ok"
            elif age is None and ingest.errors == 0:  # no round has ended, none has failed: the first runs
                status = "first ingest round running"
            else:
                status = "ingest stalled"
            self._json(
                HTTPStatus.OK if healthy else HTTPStatus.SERVICE_UNAVAILABLE,
                {"status": status, "engines": engines, "last_ingest_age_s": age,
                 "unreadable_files": len(unreadable),
                 "cannot_read": [{"path": path, "error": error} for path, error in unreadable[:HEALTHZ_UNREADABLE]]},
            )
        elif url.path == "/livez":
            self._json(HTTPStatus.OK, {"status": "ok"})
        elif url.path == FAILURES_PATH:
            if not self._authorized():
                return
            try:
                query = FailureQuery.parse(url.query)
            except QueryError as exc:
                self._json(HTTPStatus.BAD_REQUEST, {"error": str(exc), "parameter": exc.parameter})
                return
            failures, cursor = failure_page(self.server.ingest.dir / FAILURES_DIR, query)
            next_url = None if cursor is None else query.next_url(cursor)
            self._json(HTTPStatus.OK, {"failures": failures, "next": next_url})
        elif url.path.startswith(FAILURES_PATH + "/"):
            if not self._authorized():
                return
            report_id = url.path[len(FAILURES_PATH) + 1:]
            served = one_report(self.server.ingest.dir / FAILURES_DIR, report_id)
            if served is None:
                self._json(HTTPStatus.NOT_FOUND, {"error": f"no report {report_id[:200]!r} (ids: /api/v1/failures)"})
            else:
                self._json(HTTPStatus.OK, served)
        elif url.path == REPLAYS_PATH:
            if self._authorized():
                self._json(HTTPStatus.OK, replay_endpoints.listing(self.server.ingest.dir, self.server.replay_requests))
        elif url.path.startswith(REPLAYS_PATH + "/"):
            if not self._authorized():
                return
            bundle_id = url.path[len(REPLAYS_PATH) + 1:]
            path = replay_endpoints.bundle_path(self.server.ingest.dir, bundle_id)
            if path is None or not self._send_file(path, "application/zip"):
                self._json(HTTPStatus.NOT_FOUND, {"error": f"no bundle {bundle_id[:200]!r} (ids: {REPLAYS_PATH})"})
        elif url.path == OPENAPI_PATH:
            self._send(HTTPStatus.OK, openapi_document(), "application/json")
        elif url.path == "/":
            self._json(HTTPStatus.OK, {"endpoints": ["/metrics", "/healthz", "/livez", FAILURES_PATH,
                                                     FAILURES_PATH + "/<id>", REPLAYS_PATH, "POST " + REPLAYS_PATH,
                                                     REPLAYS_PATH + "/<id>", OPENAPI_PATH]})
        else:
            self._json(HTTPStatus.NOT_FOUND, {"error": f"no such endpoint: {url.path[:200]}"})

    def _send_file(self, path: Path, content_type: str) -> bool:
        """Stream a file (a bundle can be as large as ``flight_bytes``); False if it cannot be opened."""
        try:
            file = open(path, "rb")  # noqa: SIM115 (closed below, after the headers are chosen)
        except OSError:
            return False
        with file:
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(os.fstat(file.fileno()).st_size))
            self.send_header("Content-Disposition", f'attachment; filename="{path.name}"')
            self.send_header("X-Content-Type-Options", "nosniff")
            self.end_headers()
            if self.command != "HEAD":
                shutil.copyfileobj(file, self.wfile)
        return True

    def do_POST(self) -> None:
        """Only ``POST /api/v1/replays`` (kvobs/sidecar/replay_endpoints.py); a body, if any, is not read."""
        url = self._target()
        if url is None:
            return
        if url.path != REPLAYS_PATH:
            self._refuse()
            return
        try:  # a body is not expected; a small one is read and ignored, so the connection stays usable
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_POST_BODY:
            self.close_connection = True
            self._json(HTTPStatus.REQUEST_ENTITY_TOO_LARGE if length > 0 else HTTPStatus.BAD_REQUEST,
                       {"error": f"this endpoint takes no body (at most {MAX_POST_BODY} bytes, ignored)"})
            return
        self.rfile.read(length)
        if not self._authorized():
            return
        try:
            made = replay_endpoints.request(self.server.ingest.dir, url.query, self.server.replay_requests)
        except replay_endpoints.RequestError as exc:
            self._json(HTTPStatus.BAD_REQUEST, {"error": str(exc), "parameter": exc.parameter})
        except replay_endpoints.Refused as exc:  # no engine would answer: said now, not lost after REQUEST_TTL_S
            self._json(exc.status, {"error": str(exc), "engine": exc.engine, "reason": exc.reason})
        except TooSoon as exc:
            self._json(HTTPStatus.TOO_MANY_REQUESTS, {"error": str(exc), "retry_after_s": exc.retry_after},
                       headers={"Retry-After": str(math.ceil(exc.retry_after))})
        except OSError as exc:  # a read-only or full directory
            self._json(HTTPStatus.SERVICE_UNAVAILABLE, {"error": f"cannot leave the request: {exc}"})
        else:
            self._json(HTTPStatus.ACCEPTED, made)

    def _authorized(self) -> bool:
        """True without a token, or with ``Authorization: Bearer <token>``; else answers 401 itself."""
        token = self.server.token
        if token is None:
            return True
        scheme, _, given = self.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token):
            return True
        body = json.dumps({"error": "this endpoint needs Authorization: Bearer <token> (kvobs serve --token-file)"})
        self.send_response(HTTPStatus.UNAUTHORIZED)
        self.send_header("WWW-Authenticate", 'Bearer realm="kvobs"')
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body.encode())
        return False

    def do_HEAD(self) -> None:
        self.do_GET()

    def _refuse(self) -> None:
        self.send_response(HTTPStatus.METHOD_NOT_ALLOWED)
        try:
            replays = urlsplit(self.path).path == REPLAYS_PATH
        except ValueError:  # a target that does not split (do_GET's _target): not the replays endpoint
            replays = False
        self.send_header("Allow", "GET, HEAD, POST" if replays else "GET, HEAD")
        self.send_header("Content-Length", "0")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = _refuse


class ListenError(OSError):
    """The sidecar cannot bind its address."""


def serve(directory: Path, host: str = "127.0.0.1", port: int = 9464, *, token: bytes | None = None,
          ready: Callable[[str], None] | None = None) -> None:
    """Run ingest and HTTP until interrupted; checkpoint on the way out.

    ``FileNotFoundError`` if ``directory`` does not exist (a mistyped path must not look
    healthy), :class:`ListenError` if the address cannot be bound. ``ready`` gets the
    /metrics URL once the socket is bound, so nothing says "serving" before it is true.
    ``token``: the bearer token /api/v1/failures requires (None: none).
    """
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} is not a directory")
    ingest = Ingest(directory)
    try:
        server = SidecarServer((host, port), ingest, token)
    except OSError as exc:
        raise ListenError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    # The first ingest round runs in the worker, not before serve_forever(): it can take minutes (a long
    # journal replay), and /livez must answer from the bind. A pod is Ready only when every container
    # is, and a container with a startup probe only once that passes: a sidecar that answered late
    # would hold the whole vLLM pod NotReady (docker/k8s/base/vllm-kvobs.yaml gives it liveness only).
    if ready is not None:
        ready(http_url(host, server.server_address[1], "/metrics"))
    worker = threading.Thread(target=ingest.run, name="kvobs-ingest", daemon=True)
    worker.start()
    stop_sweeping = threading.Event()
    threading.Thread(target=server.replay_requests.run, args=(stop_sweeping,), name="kvobs-replay-requests",
                     daemon=True).start()
    try:
        server.serve_forever(poll_interval=0.5)
    finally:
        stop_sweeping.set()
        server.server_close()
        ingest.stop()
        worker.join(timeout=10)
