"""The sidecar under malformed and hostile HTTP, over raw sockets, against the real ``kvobs serve``.

Bad methods, long and odd paths, huge headers, huge bodies, slowloris-style
requests and more connections than the 32-connection cap. /metrics and /healthz
answer again (for slowloris: while the attack still runs, once the request-head
deadline frees the slots), nothing changed state, and the process's resident
memory (VmRSS from /proc/<pid>/status) stayed bounded.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvobs.sidecar.server import MAX_CONNECTIONS, REQUEST_DEADLINE_S
from tests.support.figures import MEASURED
from tests.support.services import Sidecar, http_get

RSS_GROWTH_LIMIT_KB = 64 * 1024


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def exchange(port: int, data: bytes, timeout: float = 15.0) -> bytes:
    """Send raw bytes, return what the server answers until it closes or goes quiet."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        with contextlib.suppress(OSError):
            s.sendall(data)
        reply = b""
        with contextlib.suppress(OSError):
            while not complete(reply):
                chunk = s.recv(65536)
                if not chunk:
                    break
                reply += chunk
        return reply


def complete(reply: bytes) -> bool:
    """A whole response with a Content-Length (the server keeps HTTP/1.1 connections open)."""
    head, sep, body = reply.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value.strip())
    return False


def status_of(reply: bytes) -> int | None:
    if not reply.startswith(b"HTTP/"):
        return None
    return int(reply.split(b" ", 2)[1])


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    s = Sidecar(tmp_path_factory.mktemp("kvobs")).start()
    yield s
    s.stop()


def healthy(sidecar: Sidecar) -> bool:
    return http_get(f"{sidecar.url}/metrics")[0] == 200 and http_get(f"{sidecar.url}/healthz")[0] == 200


def listing(directory: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(directory)), p.stat().st_size) for p in directory.rglob("*")
                  if p.name != "sidecar-state.json")


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT"])
def test_every_non_get_method_is_refused_and_changes_nothing(method: str, sidecar: Sidecar) -> None:
    before = listing(sidecar.dir)
    for path in ("/metrics", "/healthz", "/api/v1/failures", "/", "/nope"):
        reply = exchange(sidecar.port, f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{{}}".encode())
        assert status_of(reply) == 405, reply[:200]
        assert b"Allow: GET, HEAD" in reply
    assert listing(sidecar.dir) == before
    assert healthy(sidecar)


@pytest.mark.parametrize(
    ("request_bytes", "statuses"),
    [
        (b"BREW /metrics HTTP/1.1\r\n\r\n", {501}),
        (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", {414}),
        (b"GET /../../../etc/passwd HTTP/1.1\r\n\r\n", {404}),
        (b"GET /metrics/../healthz HTTP/1.1\r\n\r\n", {404}),
        (b"GET /%00%ff\xff\xfe HTTP/1.1\r\n\r\n", {400, 404}),
        (b"GET * HTTP/1.1\r\n\r\n", {404}),
        (b"GET /api/v1/failures?limit=99999999999999999999 HTTP/1.1\r\n\r\n", {400}),
        (b"GET /api/v1/failures?limit=-1&limit=x HTTP/1.1\r\n\r\n", {400}),
        (b"GET /metrics HTTP/9.9\r\n\r\n", {505, None}),  # answered without a status line (HTTP/0.9 style)
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64, {400, None}),  # a TLS hello
        (b"GET /metrics HTTP/1.1\r\n" + b"X-A: b\r\n" * 200 + b"\r\n", {431}),
        (b"GET /metrics HTTP/1.1\r\nX-Big: " + b"b" * 70_000 + b"\r\n\r\n", {431}),
        (b"\r\n\r\n\r\n", {None, 400}),
        (b"GET /metrics HTTP/1.1\r\nContent-Length: -5\r\n\r\n", {200}),
    ],
    ids=["unknown-method", "long-path", "dot-dot", "dot-dot-2", "bad-bytes", "star", "huge-limit", "bad-limit",
         "bad-version", "tls-hello", "many-headers", "huge-header", "blank-lines", "negative-length"],
)
def test_malformed_requests_get_an_error_and_the_sidecar_keeps_serving(
    request_bytes: bytes, statuses: set[int | None], sidecar: Sidecar
) -> None:
    # No line end ever comes in a TLS hello: the server would wait out its socket timeout; do not wait with it.
    reply = exchange(sidecar.port, request_bytes, timeout=2.0 if None in statuses else 15.0)
    assert status_of(reply) in statuses, reply[:300]
    assert healthy(sidecar)


@pytest.mark.slow
def test_abuse_leaves_the_sidecar_serving_with_bounded_memory(sidecar: Sidecar) -> None:
    assert sidecar.proc is not None
    pid = sidecar.proc.pid
    assert healthy(sidecar)
    rss_start = rss_kb(pid)

    # Huge bodies: a 64 MiB POST (refused unread) and a GET announcing 1 GiB it never sends in full.
    def huge_post() -> None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", sidecar.port), timeout=10) as s:
            s.sendall(b"POST /metrics HTTP/1.1\r\nContent-Length: 67108864\r\n\r\n")
            chunk = b"z" * 2**20
            for _ in range(64):
                s.sendall(chunk)

    def huge_get_body() -> None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", sidecar.port), timeout=10) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nContent-Length: 1073741824\r\n\r\n" + b"y" * 2**22)
            s.recv(4096)

    for _ in range(5):
        huge_post()
        huge_get_body()

    # Many requests, some concurrent: 400 scrapes from 8 threads.
    def scrapes() -> None:
        for _ in range(50):
            with contextlib.suppress(OSError):
                http_get(f"{sidecar.url}/metrics")

    threads = [threading.Thread(target=scrapes) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)

    # Slowloris beyond the cap: 3x MAX_CONNECTIONS connections that keep sending a header byte at a
    # time and never finish. Each holds its slot only until the request-head deadline.
    slow: list[socket.socket] = []
    attack_start = time.monotonic()
    for _ in range(3 * MAX_CONNECTIONS):
        with contextlib.suppress(OSError):
            s = socket.create_connection(("127.0.0.1", sidecar.port), timeout=5)
            s.sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
            slow.append(s)
    refused_during = http_get_status_or_none(f"{sidecar.url}/healthz")
    # The cap holds: with every slot taken by an attacker, a new connection is closed, not queued
    # or served (without the cap, the rest of this test would pass trivially).
    assert refused_during is None, refused_during
    served_again_at = None
    trace: list[tuple[float, int | None]] = []
    rss_peak = rss_kb(pid)
    while time.monotonic() - attack_start < REQUEST_DEADLINE_S + 20:
        for s in slow:
            with contextlib.suppress(OSError):
                s.sendall(b"a")
        rss_peak = max(rss_peak, rss_kb(pid))
        probe = http_get_status_or_none(f"{sidecar.url}/healthz")
        trace.append((round(time.monotonic() - attack_start, 1), probe))
        if probe == 200 and healthy_quietly(sidecar):
            served_again_at = time.monotonic() - attack_start
            break
        time.sleep(0.5)
    for s in slow:
        s.close()
    # While the attackers still dribble, the deadline frees the slots: served again within it.
    assert served_again_at is not None and served_again_at < REQUEST_DEADLINE_S + 15, trace
    assert healthy(sidecar)
    rss_end = rss_kb(pid)
    assert rss_end - rss_start < RSS_GROWTH_LIMIT_KB and rss_peak - rss_start < RSS_GROWTH_LIMIT_KB, (
        rss_start, rss_peak, rss_end)
    MEASURED["http_abuse.rss_kb(start, peak, end)"] = (rss_start, rss_peak, rss_end)
    MEASURED["http_abuse.healthz_at_start_of_96_slow_connections"] = refused_during
    MEASURED["http_abuse.seconds_until_served_again_during_slowloris"] = round(served_again_at, 2)


def http_get_status_or_none(url: str) -> int | None:
    try:
        return http_get(url)[0]
    except OSError:
        return None


def healthy_quietly(sidecar: Sidecar) -> bool:
    try:
        return healthy(sidecar)
    except OSError:
        return False
