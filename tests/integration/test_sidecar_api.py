"""The sidecar as an operator meets it: ``kvobs serve``'s command line and environment, gzip on
/metrics, and /api/v1/failures's filters, paging and bucket bounds, over real failure reports.

The reports come from real failed loads: vLLM's real CPU manager under ``kvobs.observe()``;
the sidecar is a separate ``kvobs serve`` process.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
from vllm.v1.kv_offload.base import ReqContext

import kvobs
from kvobs.codes import BUCKETS
from kvobs.sidecar import failures
from kvobs.sidecar.failures import FailureQuery, failure_page
from tests.support.services import ROOT, Sidecar, clean_env, free_port, http_get, wait_for
from tests.support.vllm_env import cpu_extra, create_manager, evicted_after_lookup_then_coverage_mismatch, key


def kvobs_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvobs.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_version_is_the_installed_distributions() -> None:
    from importlib.metadata import version

    run = kvobs_cli("--version")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"kvobs {version('kvobs')}"


def test_serve_refuses_a_directory_that_does_not_exist(tmp_path: Path) -> None:
    # Before: a mistyped --dir answered /healthz 200 with engines 0, a healthy-looking sidecar of nothing.
    missing = tmp_path / "kvobs-typo"
    run = kvobs_cli("serve", "--dir", str(missing), "--port", str(free_port()), env=clean_env())
    assert run.returncode == 2
    assert f"--dir {missing} does not exist" in run.stderr
    by_env = kvobs_cli("serve", "--port", str(free_port()), env=clean_env(KVOBS_DIR=str(missing)))
    assert by_env.returncode == 2 and f"KVOBS_DIR {missing} does not exist" in by_env.stderr
    unset = kvobs_cli("serve", env=clean_env())
    assert unset.returncode == 2 and "pass --dir or set KVOBS_DIR" in unset.stderr


@pytest.mark.parametrize("port", ["http", "0", "70000"])
def test_a_bad_port_is_named_by_where_it_came_from(tmp_path: Path, port: str) -> None:
    env = clean_env(KVOBS_DIR=str(tmp_path), KVOBS_PORT=port)
    run = kvobs_cli("serve", env=env)
    assert run.returncode == 2 and "KVOBS_PORT must be a port number in 1..65535" in run.stderr, run.stderr
    flag = kvobs_cli("serve", "--dir", str(tmp_path), "--port", port, env=clean_env())
    assert flag.returncode == 2 and "--port: must be a port number in 1..65535" in flag.stderr, flag.stderr


@pytest.fixture
def serve_process() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=15)


def test_serve_takes_its_settings_from_the_environment_and_a_flag_overrides_it(
    tmp_path: Path, serve_process: list[subprocess.Popen[bytes]]
) -> None:
    env_port, flag_port = free_port(), free_port()
    env = clean_env(KVOBS_DIR=str(tmp_path), KVOBS_HOST="127.0.0.1", KVOBS_PORT=str(env_port))
    for args in ((), ("--port", str(flag_port))):
        serve_process.append(subprocess.Popen([sys.executable, "-m", "kvobs.cli", "serve", *args], cwd=ROOT, env=env,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for port in (env_port, flag_port):
        wait_for(lambda port=port: http_get(f"http://127.0.0.1:{port}/healthz")[0] == 200, what=f"sidecar on {port}")


def test_metrics_are_gzipped_when_the_scraper_asks(tmp_path: Path) -> None:
    sidecar = Sidecar(tmp_path / "kvobs").start()
    try:
        plain = http_get(f"{sidecar.url}/metrics")
        zipped = http_get(f"{sidecar.url}/metrics", {"Accept-Encoding": "gzip"})
    finally:
        sidecar.stop()
    assert plain[0] == zipped[0] == 200
    assert zipped[2][:2] == b"\x1f\x8b"  # the gzip magic: compressed, not sent as is
    assert b"kvobs_sidecar_engines" in plain[2] and b"kvobs_sidecar_engines" in gzip.decompress(zipped[2])


def _family_names(body: bytes) -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families

    return {family.name for family in text_string_to_metric_families(body.decode())}


def test_metrics_take_name_filters_as_prometheus_client_does_and_ignore_other_parameters(tmp_path: Path) -> None:
    """/metrics?name[]=... returns only those series (prometheus_client's own exporter does, and scrape
    configs use it); any other parameter a scrape config adds is ignored, as on /healthz and /livez:
    only /api/v1/failures refuses what it does not know."""
    sidecar = Sidecar(tmp_path / "kvobs").start()
    try:
        whole = http_get(f"{sidecar.url}/metrics")
        named = http_get(f"{sidecar.url}/metrics?" + urlencode([("name[]", "kvobs_sidecar_engines"),
                                                                  ("name[]", "kvobs_sidecar_records_total")]))
        other = http_get(f"{sidecar.url}/metrics?module=kvobs&target=x")
        health = http_get(f"{sidecar.url}/healthz?verbose=1")[0], http_get(f"{sidecar.url}/livez?x")[0]
        refused = http_get(f"{sidecar.url}/api/v1/failures?module=kvobs")[0]
    finally:
        sidecar.stop()
    assert whole[0] == named[0] == other[0] == 200
    assert {"kvobs_sidecar_engines", "kvobs_sidecar_build_info"} <= _family_names(whole[2])
    assert _family_names(named[2]) == {"kvobs_sidecar_engines", "kvobs_sidecar_records"}
    assert _family_names(other[2]) == _family_names(whole[2])
    assert health == (200, 200) and refused == 400


# ---- /api/v1/failures over real reports -------------------------------------------------------------


def coverage_mismatches(manager: Any, n: int, tag: str) -> None:
    """``n`` real failed loads of chunks never stored (cause coverage_mismatch)."""
    for i in range(n):
        context = ReqContext(f"{tag}-{i}")
        manager.on_new_request(context)
        with pytest.raises(AssertionError, match="cause: coverage_mismatch"):
            manager.prepare_load([key(10_000 + i)], context)


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, float]]:
    """16 real failure reports: engine "0" of model m-a (one evicted_after_lookup, 12
    coverage_mismatch), engine "1" of model m-b (3 coverage_mismatch); and a time between
    m-a's first 7 and the rest."""
    directory = tmp_path_factory.mktemp("failures-api")
    a = kvobs.observe(create_manager(cpu_extra(4)), dir=str(directory), engine="0", model_name="m-a")
    b = kvobs.observe(create_manager(cpu_extra(4)), dir=str(directory), engine="1", model_name="m-b")
    try:
        writer, victim = ReqContext("writer"), ReqContext("victim")
        for context in (writer, victim):
            a.on_new_request(context)
        evicted_after_lookup_then_coverage_mismatch(a, writer, victim)  # 2 reports
        coverage_mismatches(a, 5, "early")
        coverage_mismatches(b, 3, "b")
        time.sleep(0.05)
        middle = time.time()
        time.sleep(0.05)
        coverage_mismatches(a, 6, "late")
        wait_for(lambda: len(list((directory / "failures").glob("*.json"))) == 16, what="16 report files")
    finally:
        a.shutdown()
        b.shutdown()
    yield directory, middle


@pytest.fixture(scope="module")
def api(reports: tuple[Path, float]) -> Iterator[str]:
    sidecar = Sidecar(reports[0]).start()
    yield f"{sidecar.url}/api/v1/failures"
    sidecar.stop()


def get(url: str, **params: Any) -> tuple[int, dict[str, Any]]:
    query = urlencode([(k, v) for k, values in params.items()
                       for v in (values if isinstance(values, list) else [values])])
    status, _, body = http_get(f"{url}?{query}" if query else url)
    return status, json.loads(body)


def all_pages(api: str, **params: Any) -> list[list[dict[str, Any]]]:
    status, page = get(api, **params)
    pages = []
    while True:
        assert status == 200, page
        pages.append(page["failures"])
        if page["next"] is None:
            return pages
        assert page["next"].startswith("/api/v1/failures?")
        status, _, body = http_get(api.rsplit("/api/v1/failures", 1)[0] + page["next"])
        page = json.loads(body)


def test_filters_select_by_engine_model_cause_and_time(api: str, reports: tuple[Path, float]) -> None:
    _, middle = reports
    status, everything = get(api, limit=100)
    assert status == 200 and len(everything["failures"]) == 16 and everything["next"] is None
    assert {(r["engine"], r["model_name"]) for r in everything["failures"]} == {("0", "m-a"), ("1", "m-b")}
    assert len(get(api, engine="0", limit=100)[1]["failures"]) == 13
    assert len(get(api, model_name="m-b", limit=100)[1]["failures"]) == 3
    assert len(get(api, engine=["0", "1"], limit=100)[1]["failures"]) == 16  # a repeated filter: any value
    [only] = get(api, cause="evicted_after_lookup")[1]["failures"]
    assert (only["engine"], only["req_id"]) == ("0", "victim")
    late = get(api, since=repr(middle), limit=100)[1]["failures"]
    assert sorted(r["req_id"] for r in late) == sorted(f"late-{i}" for i in range(6))
    assert get(api, engine="1", cause="evicted_after_lookup")[1] == {"failures": [], "next": None}


def test_paging_serves_every_report_once_newest_first(api: str) -> None:
    pages = all_pages(api, limit=5)
    assert [len(p) for p in pages] == [5, 5, 5, 1]
    ids = [r["id"] for page in pages for r in page]
    assert len(set(ids)) == 16 and ids == sorted(ids, reverse=True)
    times = [r["time"] for page in pages for r in page]
    assert times == sorted(times, reverse=True)
    filtered = all_pages(api, limit=4, engine="0", cause="coverage_mismatch")  # the filters carry over
    assert [len(p) for p in filtered] == [4, 4, 4]
    assert all(r["engine"] == "0" and r["cause"] == "coverage_mismatch" for page in filtered for r in page)


def test_age_histograms_carry_their_bucket_bounds(api: str) -> None:
    failures = get(api, cause="evicted_after_lookup")[1]["failures"]
    ages = failures[0]["missing_summary"]["ages"]
    assert ages  # the evicted chunk had a residency: one histogram, for its KV group
    for histogram in ages.values():
        assert histogram["bounds"] == [*BUCKETS, "+Inf"]
        assert len(histogram["bounds"]) == len(histogram["counts"]) and sum(histogram["counts"]) >= 1


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"cause": "evicted"}, "cause: must be one of evicted_after_lookup"),
        ({"engine_id": "0"}, "engine_id: unknown parameter"),
        ({"since": "yesterday"}, "since: must be unix seconds"),
        ({"since": "nan"}, "since: must be unix seconds"),
        ({"limit": "0"}, "limit: must be an integer"),
        ({"limit": ["5", "6"]}, "limit: given 2 times"),
        ({"engine": ""}, "engine: must be an engine label"),
    ],
)
def test_a_bad_query_is_a_400_naming_the_problem(api: str, params: dict[str, Any], named: str) -> None:
    status, body = get(api, **params)
    assert status == 400 and named in body["error"] and body["parameter"] == named.partition(":")[0], body


def test_a_page_stops_at_its_scan_budget_and_the_cursor_goes_on(
    reports: tuple[Path, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each request reads at most MAX_SCANNED report files: a filter matching nothing in 100k reports
    # must not read them all in one request. 3 here, so a page of engine "1" ends early with a cursor.
    directory = reports[0] / "failures"
    monkeypatch.setattr(failures, "MAX_SCANNED", 3)
    query = FailureQuery(limit=10, engines=frozenset({"1"}))
    seen: list[str] = []
    cursor: str | None = None
    for _ in range(20):
        page, cursor = failure_page(directory, FailureQuery(query.limit, query.engines, before=cursor))
        seen.extend(r["req_id"] for r in page)
        if cursor is None:
            break
    assert cursor is None and sorted(seen) == ["b-0", "b-1", "b-2"]
