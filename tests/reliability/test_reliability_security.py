"""Security: where the sidecar listens, what kvobs writes where and with which modes, and that no
prompt content leaves vLLM through kvobs (records carry request ids, key hash prefixes, token
positions; never token ids or text).
"""

from __future__ import annotations

import json
import os
import socket
import stat
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
from opentelemetry import trace

from tests.support.scheduler_harness import DOCUMENT, FILLER, reproduce_promotion_evicts_hit
from tests.support.services import ROOT, OtlpReceiver, Sidecar, free_port, http_get, wait_for

ENGINE = "tests.support.engine_process"  # run as a module, the repository root on PYTHONPATH


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    return [(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN]


def outward_ip() -> str | None:
    """This machine's non-loopback address, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            ip = str(s.getsockname()[0])
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def test_sidecar_listens_on_loopback_only_by_default(tmp_path: Path) -> None:
    sidecar = Sidecar(tmp_path / "kvobs").start()  # `kvobs serve --dir D --port P`: no --host
    try:
        assert sidecar.proc is not None
        assert listening_addresses(sidecar.proc.pid) == [("127.0.0.1", sidecar.port)]
        ip = outward_ip()
        if ip is not None:
            with pytest.raises(OSError), socket.create_connection((ip, sidecar.port), timeout=2):
                pass
    finally:
        sidecar.stop()


def test_sidecar_binds_elsewhere_only_when_told(tmp_path: Path) -> None:
    port = free_port()
    (tmp_path / "k").mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "kvobs.cli", "serve", "--dir", str(tmp_path / "k"),
                             "--host", "0.0.0.0", "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: http_get(f"http://127.0.0.1:{port}/healthz")[0] == 200, what="sidecar")
        assert listening_addresses(proc.pid) == [("0.0.0.0", port)]
    finally:
        proc.terminate()
        proc.wait(timeout=15)


@pytest.mark.slow
def test_files_only_inside_the_kvobs_dir_with_private_modes(tmp_path: Path) -> None:
    """An engine that dies on a failed load and a sidecar, both with umask 0 and an empty cwd, HOME and TMPDIR."""
    directory, elsewhere = tmp_path / "kvobs", tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "HOME": str(elsewhere), "TMPDIR": str(elsewhere), "PYTHONPATH": str(ROOT)}
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    env.pop("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", None)

    def umask0() -> None:
        os.umask(0)

    engine = subprocess.run([sys.executable, "-m", ENGINE, str(directory), "dp0", "20", "fail"], env=env,
                            cwd=elsewhere, preexec_fn=umask0, capture_output=True, timeout=120)
    assert engine.returncode == 1 and b"cause: evicted_after_lookup" in engine.stderr
    port = free_port()
    sidecar = subprocess.Popen([sys.executable, "-m", "kvobs.cli", "serve", "--dir", str(directory),
                                "--port", str(port)], env=env, cwd=elsewhere, preexec_fn=umask0,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: json.loads(http_get(f"http://127.0.0.1:{port}/api/v1/failures")[2])["failures"],
                 what="the failure report served")
    finally:
        sidecar.terminate()
        sidecar.wait(timeout=15)
    written = list(directory.rglob("*"))
    assert {p.name for p in written} >= {"journal", "failures", "sidecar-state.json"}
    for path in [directory, *written]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))
    leaked = [p for p in elsewhere.rglob("*") if "__pycache__" not in p.parts and "vllm" not in p.parts
              and ".cache" not in p.parts and ".config" not in p.parts]
    assert leaked == [], leaked  # nothing in cwd, HOME or TMPDIR (vLLM's own caches excepted)


def test_no_prompt_content_leaves_through_kvobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """#50014 through the real connector scheduler with a real prompt; inspect everything kvobs emitted."""
    receiver = OtlpReceiver()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"{receiver.endpoint}/v1/traces")
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: trace.NoOpTracerProvider())
    directory = tmp_path / "kvobs"
    try:
        result = reproduce_promotion_evicts_hit(
            {"kvobs": {"inner_spec": "TieringOffloadingSpec", "engine": "dp0", "dir": str(directory)}},
            spec_name="ObservedOffloadingSpec", spec_module_path="kvobs.vllm",
        )
        assert isinstance(result.error, AssertionError) and "cause: evicted_after_lookup" in str(result.error)
        spans = wait_for(receiver.spans, what="the failure span")
    finally:
        receiver.stop()
    prompt = [*DOCUMENT, *FILLER]
    tokens = set(prompt)
    blobs: dict[str, bytes] = {p.name: p.read_bytes() for p in directory.rglob("*") if p.is_file()}
    blobs["span"] = b"".join(s.SerializeToString() for s in spans)
    assert any(name.endswith(".jsonl") for name in blobs) and any(name.endswith(".json") for name in blobs)

    # Structured: no integer a record carries (besides process ids) is a token id of the prompt.
    def integers(value: Any, field: str = "") -> list[int]:
        if isinstance(value, bool):
            return []
        if isinstance(value, int):
            return [] if field == "pid" else [value]
        if isinstance(value, dict):
            return [i for k, v in value.items() for i in integers(v, k)]
        if isinstance(value, list):
            return [i for v in value for i in integers(v, field)]
        return []

    for name, blob in blobs.items():
        if name.endswith((".json", ".jsonl")):
            for line in blob.decode().splitlines():
                found = tokens.intersection(integers(json.loads(line))) if line.strip() else set()
                assert not found, (name, sorted(found)[:5])

    # Raw: no run of 3 prompt tokens as text or packed as int32/int64 anywhere (journal, reports,
    # checkpoint, the exported span's protobuf).
    needles = []
    for i in range(len(prompt) - 2):
        run = prompt[i:i + 3]
        needles += [", ".join(map(str, run)).encode(), ",".join(map(str, run)).encode(),
                    struct.pack("<3i", *run), struct.pack("<3q", *run)]
    for name, blob in blobs.items():
        for needle in needles:
            assert needle not in blob, (name, needle)

    # What does leave, said in docs/reliability.md: request ids, key hash prefixes, token positions.
    report = json.loads(next(b for n, b in blobs.items() if n.endswith(".json") and "state" not in n))
    assert report["req_id"] == result.request_id and report["missing"][0]["end_token"] == 80
    assert report["missing"][0]["key"] == f"{result.evicted_hit_key[:8].hex()}/0"
