"""Issue 20: ``kvobs serve`` as an operator runs it, each time a real process.

IPv6 and dual-stack binds; "serving" said only once the socket is bound; JSON logs and a log level;
the standard process_/python_ series; a bearer token for /api/v1/failures; a sidecar of another uid
than the engines' that says what it cannot read (in /healthz and a gauge) and counts a checkpoint
it may not open as unreadable, not corrupt; the failure-time gauges the load-failure alerts read.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvobs.sidecar.ingest import CHECKPOINT
from tests.support.services import ROOT, free_port, http_get, wait_for
from tests.support.sidecar_input import scrape, skipped, write_engine


def start(directory: Path, *args: str, port: int | None = None, prefix: tuple[str, ...] = ()) -> tuple[
        subprocess.Popen[str], int]:
    """``kvobs serve`` with ``args`` (its --dir and --port given here) as a process of its own."""
    port = port or free_port()
    proc = subprocess.Popen([*prefix, sys.executable, "-m", "kvobs.cli", "serve", "--dir", str(directory),
                             "--port", str(port), *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    return proc, port


def stop(proc: subprocess.Popen[str]) -> tuple[str, str]:
    if proc.poll() is None:
        proc.terminate()
    out, err = proc.communicate(timeout=20)
    return out, err


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not ipv6_loopback(), reason="this machine has no IPv6 loopback")
def test_host_double_colon_serves_ipv6_and_ipv4_and_says_so_after_the_bind(tmp_path: Path) -> None:
    proc, port = start(tmp_path, "--host", "::")
    try:
        wait_for(lambda: http_get(f"http://[::1]:{port}/healthz")[0] == 200, what="the sidecar over IPv6")
        assert http_get(f"http://127.0.0.1:{port}/healthz")[0] == 200  # dual stack: IPv4 on the same socket
    finally:
        _, err = stop(proc)
    assert f"serving http://[::]:{port}/metrics" in err, err


@pytest.mark.skipif(not ipv6_loopback(), reason="this machine has no IPv6 loopback")
def test_an_ipv6_address_in_brackets_binds_that_address_only(tmp_path: Path) -> None:
    proc, port = start(tmp_path, "--host", "[::1]")
    try:
        wait_for(lambda: http_get(f"http://[::1]:{port}/livez")[0] == 200, what="the sidecar on ::1")
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        stop(proc)


def test_a_port_in_use_exits_2_without_ever_saying_serving(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        proc, _ = start(tmp_path, port=taken.getsockname()[1])
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2, err
    assert "cannot listen on 127.0.0.1:" in err
    assert "serving" not in out + err


def test_json_logs_at_the_level_asked_for(tmp_path: Path) -> None:
    (tmp_path / CHECKPOINT).write_text("{not json")  # a warning-level line to log
    proc, port = start(tmp_path, "--log-format", "json", "--log-level", "info")
    try:
        wait_for(lambda: http_get(f"http://127.0.0.1:{port}/healthz")[0] == 200, what="the sidecar")
    finally:
        _, err = stop(proc)
    entries = [json.loads(line) for line in err.splitlines() if line.strip()]
    assert {e["level"] for e in entries} >= {"info", "error"}, err
    assert all(set(e) >= {"time", "level", "logger", "message"} for e in entries)
    assert any("serving" in e["message"] for e in entries if e["level"] == "info")

    env = {**os.environ, "KVOBS_LOG_LEVEL": "error", "KVOBS_LOG_FORMAT": "text"}
    proc = subprocess.Popen([sys.executable, "-m", "kvobs.cli", "serve", "--dir", str(tmp_path), "--port",
                             str(free_port())], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    time.sleep(2)
    _, err = stop(proc)
    assert "serving" not in err and "INFO" not in err, err  # the variable set the level: info is not logged

    bad = subprocess.run([sys.executable, "-m", "kvobs.cli", "serve", "--dir", str(tmp_path)], cwd=ROOT,
                         env={**os.environ, "KVOBS_LOG_FORMAT": "xml"}, capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "KVOBS_LOG_FORMAT" in bad.stderr


def test_process_and_platform_series_next_to_kvobs(tmp_path: Path) -> None:
    proc, port = start(tmp_path)
    try:
        wait_for(lambda: http_get(f"http://127.0.0.1:{port}/healthz")[0] == 200, what="the sidecar")
        names = {name for name, _ in scrape(f"http://127.0.0.1:{port}")}
    finally:
        stop(proc)
    assert {"process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds",
            "python_info", "kvobs_sidecar_build_info"} <= names, names


def test_a_bearer_token_guards_the_failure_reports_only(tmp_path: Path) -> None:
    write_engine(tmp_path / "kvobs", "e0", 3, fail=True)
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")  # as a mounted Secret may end in a newline
    proc, port = start(tmp_path / "kvobs", "--token-file", str(token_file))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: http_get(f"{url}/healthz")[0] == 200, what="the sidecar")
        status, _, body = http_get(f"{url}/api/v1/failures")
        assert status == 401 and b"Bearer" in body
        assert http_get(f"{url}/api/v1/failures", {"Authorization": "Bearer wrong"})[0] == 401
        status, _, body = http_get(f"{url}/api/v1/failures", {"Authorization": "Bearer s3cret-token"})
        assert status == 200 and [f["engine"] for f in json.loads(body)["failures"]] == ["e0"]
        assert http_get(f"{url}/metrics")[0] == 200 and http_get(f"{url}/livez")[0] == 200
    finally:
        stop(proc)
    for content in ("", "two words"):
        token_file.write_text(content)
        bad = subprocess.run([sys.executable, "-m", "kvobs.cli", "serve", "--dir", str(tmp_path / "kvobs"),
                              "--token-file", str(token_file)], cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert bad.returncode == 2 and "token file" in bad.stderr, bad.stderr
    missing = subprocess.run([sys.executable, "-m", "kvobs.cli", "serve", "--dir", str(tmp_path / "kvobs")], cwd=ROOT,
                             env={**os.environ, "KVOBS_TOKEN_FILE": str(tmp_path / "nope")}, capture_output=True,
                             text=True, timeout=30)
    assert missing.returncode == 2 and "cannot read the token file" in missing.stderr


def test_the_failure_time_gauges_survive_a_sidecar_restart(tmp_path: Path) -> None:
    """The newest and the previous failure of each cause, from the reports (checkpointed with the rest)."""
    directory = tmp_path / "kvobs"
    before = time.time()
    write_engine(directory, "e0", 2, fail=True)
    proc, port = start(directory)
    url = f"http://127.0.0.1:{port}"
    labels = frozenset({("model_name", ""), ("engine", "e0"), ("cause", "coverage_mismatch")})
    try:
        values = wait_for(lambda: (v := scrape(url)).get(("kvobs_last_load_failure_timestamp_seconds", labels))
                          and v, what="the failure's time")
        first = values["kvobs_last_load_failure_timestamp_seconds", labels]
        assert before - 1 <= first <= time.time()
        assert values["kvobs_previous_load_failure_timestamp_seconds", labels] == 0
        other = frozenset({("model_name", ""), ("engine", "e0"), ("cause", "unknown")})
        assert values["kvobs_last_load_failure_timestamp_seconds", other] == 0  # every cause pre-initialised
    finally:
        stop(proc)  # checkpoints on the way out
    time.sleep(0.01)
    write_engine(directory, "e0", 1, fail=True)  # a second failure of the same cause while the sidecar is away
    proc, port = start(directory)
    url = f"http://127.0.0.1:{port}"
    try:
        values = wait_for(lambda: (v := scrape(url)).get(("kvobs_previous_load_failure_timestamp_seconds", labels))
                          and v, what="the repeat")
        assert values["kvobs_previous_load_failure_timestamp_seconds", labels] == first
        assert values["kvobs_last_load_failure_timestamp_seconds", labels] > first
    finally:
        stop(proc)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and util-linux setpriv to run the sidecar as another uid")
def test_a_sidecar_of_another_uid_says_what_it_cannot_read(tmp_path: Path) -> None:
    """The engines' files belong to root, 0600 in 0700 directories; the sidecar runs as nobody (the
    kvobs directory itself is open, as an emptyDir is). /healthz names each path it cannot read, the
    gauge counts them, the checkpoint it may not open is unreadable (not corrupt), and its failure
    to write a checkpoint is not an internal error on every round."""
    directory = tmp_path / "kvobs"
    write_engine(directory, "e0", 4, fail=True)
    (directory / CHECKPOINT).write_text("{}")
    os.chmod(directory / CHECKPOINT, 0o600)
    os.chmod(directory, 0o777)
    # As test_reliability_sidecar_input.serve(): root without the capabilities that let it open any file,
    # so the modes bind it as they bind another uid (nobody cannot run this interpreter under /root).
    nobody = ("setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all", "--")
    for sub in ("journal", "failures"):
        os.chmod(directory / sub, 0o700)
        os.chown(directory / sub, 12345, 12345)
    os.chown(directory / CHECKPOINT, 12345, 12345)
    proc, port = start(directory, prefix=nobody)
    url = f"http://127.0.0.1:{port}"
    try:
        health = wait_for(lambda: (h := json.loads(http_get(f"{url}/healthz")[2])).get("unreadable_files", 0) >= 3
                          and h, what="the unreadable paths in /healthz")
        time.sleep(6)  # past a checkpoint interval: the failed write must not count as an internal error
        values = scrape(url)
        health_code, _, body = http_get(f"{url}/healthz")
        health = json.loads(body)
    finally:
        stop(proc)
    # Still 200 (the ingest runs: /healthz is no readiness signal), but its status does not say "ok".
    n = health["unreadable_files"]
    assert health_code == 200 and health["status"] == f"reads no engine and cannot read {n} paths (cannot_read)", health
    paths = {entry["path"] for entry in health["cannot_read"]}
    assert {str(directory / "journal"), str(directory / "failures"), str(directory / CHECKPOINT)} <= paths, health
    assert health["engines"] == 0 and health["unreadable_files"] == len(health["cannot_read"])
    assert values["kvobs_sidecar_unreadable_files", frozenset()] == health["unreadable_files"]
    assert skipped(values, "checkpoint", "unreadable") == 1 and skipped(values, "checkpoint", "corrupt") == 0
    assert values["kvobs_sidecar_internal_errors_total", frozenset()] == 0
    assert values["kvobs_sidecar_engines", frozenset()] == 0


def _big_journal_dir(directory: Path, files: int = 16, removals: int = 20_000) -> None:
    """A kvobs directory whose first ingest round takes seconds: ``files`` journals of ~4 MB each (one
    real engine's journal, copied under other writers' names), as after a long run or a sidecar restart
    without its checkpoint."""
    write_engine(directory, "e0", removals)
    [journal] = (directory / "journal").glob("e0-*.jsonl")
    for i in range(1, files):
        shutil.copyfile(journal, journal.with_name(f"e{i}-{1000 + i}.000000.jsonl"))


@pytest.mark.slow
def test_livez_answers_while_the_first_ingest_round_still_runs(tmp_path: Path) -> None:
    """Kubernetes counts a container with no readiness probe as ready once its startup probe passes:
    /livez must answer from the bind, not once a long first round (a journal replay) is over; /healthz
    and /metrics say that the first round is still running, and then that it is done."""
    directory = tmp_path / "kvobs"
    _big_journal_dir(directory)
    proc, port = start(directory, "--log-level", "info")
    url = f"http://127.0.0.1:{port}"
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "serving" in line:
                break
        else:
            raise AssertionError("kvobs serve ended without saying serving")
        said_serving = time.monotonic()
        wait_for(lambda: http_get(f"{url}/livez", timeout=1)[0] == 200, timeout=1.0, what="/livez after serving")
        livez_after = time.monotonic() - said_serving
        health_status, _, health_body = http_get(f"{url}/healthz")
        health = json.loads(health_body)
        poll_time = scrape(url)[("kvobs_sidecar_last_poll_timestamp_seconds", frozenset())]
        wait_for(lambda: http_get(f"{url}/healthz")[0] == 200, timeout=120, what="the first round's end")
        round_took = time.monotonic() - said_serving
        done = json.loads(http_get(f"{url}/healthz")[2])
    finally:
        stop(proc)
    assert livez_after < 1.0 and round_took > 2 * livez_after + 1.0, (livez_after, round_took)  # seconds apart
    assert health_status == 503 and health["status"] == "first ingest round running", health
    assert health["last_ingest_age_s"] is None and poll_time == 0.0
    assert done["status"] == "ok" and done["engines"] >= 1, done
