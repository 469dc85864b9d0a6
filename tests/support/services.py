"""Real services for the export tests: the kvobs sidecar, Debian's Prometheus, an OTLP/HTTP receiver."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

ROOT = Path(__file__).resolve().parents[2]


def clean_env(**more: str) -> dict[str, str]:
    """This environment without kvobs's settings (``KVOBS_*``), plus ``more``: a command as an operator runs it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOBS_")}
    return {**env, **more}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(check: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except Exception as exc:  # not up yet
            last = exc
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


def http_get(url: str, headers: dict[str, str] | None = None, timeout: float = 10) -> tuple[int, str, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.headers.get("Content-Type", ""), response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("Content-Type", ""), err.read()


class Sidecar:
    """``kvobs serve`` as a separate process, as in production."""

    def __init__(self, directory: Path, *args: str) -> None:
        """``args``: more options of ``kvobs serve`` (e.g. ``--token-file PATH``)."""
        self.dir = directory
        self.args = args
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 (open for the life of the process and after)
        """Its standard error, a file: a pipe nobody reads would block its logging once full."""

    def start(self) -> Sidecar:
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # as a deployment's volume exists before it starts
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvobs.cli", "serve", "--dir", str(self.dir), "--port", str(self.port),
             *self.args],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self.stderr,
        )
        wait_for(lambda: http_get(f"{self.url}/healthz")[0] == 200, what="sidecar /healthz")
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=15)

    def log_lines(self) -> list[str]:
        """What it has written to standard error so far, by line."""
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace").splitlines()


class Prometheus:
    """Debian's prometheus on 127.0.0.1, scraping the sidecar every second."""

    def __init__(self, workdir: Path, targets: list[str], jobs: dict[str, list[str]] | None = None) -> None:
        """Scrapes ``targets`` as job ``kvobs``, and each of ``jobs`` (name -> targets) as its own job."""
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("Debian's prometheus is not installed: `make test` installs it (apt-get)")
        self.binary = binary
        self.port = free_port()
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            + "".join(
                f"  - job_name: {name}\n    static_configs: [{{targets: {json.dumps(job_targets)}}}]\n"
                for name, job_targets in {"kvobs": targets, **(jobs or {})}.items()
            )
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Prometheus:
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={self.workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_for(lambda: http_get(f"http://127.0.0.1:{self.port}/-/ready")[0] == 200, what="prometheus ready")
        return self

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query, at ``at`` (Unix seconds) if given, else at Prometheus's now."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(params)
        status, _, body = http_get(url)
        payload = json.loads(body)
        assert status == 200 and payload["status"] == "success", payload
        return list(payload["data"]["result"])

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=15)


class OtlpReceiver:
    """An OTLP/HTTP (protobuf) trace receiver: decodes what the SDK's exporter sends."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        received = self.requests

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                return

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                message = ExportTraceServiceRequest()
                message.ParseFromString(body)
                received.append(message)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spans(self) -> list[Any]:
        return [
            span
            for request in self.requests
            for resource_spans in request.resource_spans
            for scope_spans in resource_spans.scope_spans
            for span in scope_spans.spans
        ]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


SPAN = "kv_offload.prepare_load"  # the span of a failed load (kvobs/tracing.py)


def value_of(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [value_of(v) for v in value.array_value.values]
    return getattr(value, kind)


def attrs(items: Any) -> dict[str, Any]:
    return {kv.key: value_of(kv.value) for kv in items}


def received(receiver: OtlpReceiver) -> list[tuple[dict[str, Any], Any]]:
    """(resource attributes, span) of every failure span the receiver got."""
    return [
        (attrs(resource_spans.resource.attributes), span)
        for request in receiver.requests
        for resource_spans in request.resource_spans
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
        if span.name == SPAN
    ]
