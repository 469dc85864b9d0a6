"""What an operator reads when things start, restart and stop: every count panel and the failure recording
rule equal the failures a scenario injected, through a real scraping Prometheus (issue 29, item 1).

Each scenario runs a real ``kvobs serve`` sidecar over journals written by kvobs's own writer
(tests/support/scripted_engine.py: each failed load is one failure, one missing chunk with an eviction
age, one capacity eviction), scraped every second by Debian's Prometheus with the shipped rule files.
Then each count query of the shipped dashboard, its variables substituted as Grafana would, is
evaluated through Prometheus's HTTP API: the instant stats (``$__range``) at the range's end, the
per-step panels (``$__interval``) as Grafana's range query, whose steps must add up to the truth;
and the recording rule ``engine_cause:kvobs_load_failures:increase1h``. The truth is what the test
did, counted by the clock: each boundary is seconds away from any event and its first scrape.

Scenarios: a pod that starts inside the range with its first failure in its first scrape, then
vLLM restarted in the same pod (a new writer: the sidecar's counters go on); a sidecar restart
(a scrape gap, a failure during it, the counters resumed from the checkpoint), with the failure
alert firing throughout under one ``activeAt``; a Prometheus restarted without its storage. The
long ranges (an engine idle for days, counters far from 0 at their first scrape) are
tests/integration/test_dashboard_counts.py's, in promtool.
"""

from __future__ import annotations

import json
import math
import shutil
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dashboards.promql import ENGINE_START
from tests.support.dashboards import panel_queries, substitute
from tests.support.scripted_engine import ScriptedEngine
from tests.support.services import ROOT, Prometheus, Sidecar, http_get, wait_for

pytestmark = pytest.mark.tools

DASHBOARD = ROOT / "dashboards" / "kvobs-offload.json"
RULE_FILES = sorted((ROOT / "dashboards" / "rules").glob("*.yaml"))
RULE = "engine_cause:kvobs_load_failures:increase1h"
PER_FAILURE = {
    # What one scripted failed load adds to each series a count panel reads (the histograms': each bucket
    # at or above the observation, so the largest bucket is the count).
    "kvobs_load_failures_total": 1, "kvobs_missing_chunks_total": 1,
    "kvobs_missing_chunk_eviction_age_seconds_bucket": 1, "kvobs_chunk_residency_seconds_bucket": 1,
    "kvobs_recomputed_loads_total": 0, "kvobs_recompute_alarms_total": 0,  # survive mode is off
    "kvobs_evicted_chunks_total": 1, "kvobs_evicted_unread_chunks_total": 1,  # its chunk, never loaded
    "kvobs_stored_chunks_total": 0, "kvobs_loaded_chunks_total": 0,  # no tier store or load of its own
    "kvobs_stored_bytes_total": 0, "kvobs_loaded_bytes_total": 0,
    "kvobs_written_chunks_total": 0, "kvobs_read_once_chunks_total": 0,  # nothing written by any path either
    "kvobs_offload_exceptions_total": 0,  # the failed load kvobs explains is not an exception at the boundary
}
STEPS = (1, 5)  # Grafana's step (``$__interval``): the scrape interval, and longer
SETTLE_S = 3.0  # a boundary this far from every event: its journal flush, the sidecar's poll, a scrape


def count_queries() -> list[tuple[str, str, list[str]]]:
    """(where, expr, counted metrics) of every count query of the shipped dashboard: the forms of
    dashboards/promql.py, which read the engine start gauge. One metric: a count; two: a ratio of counts."""
    out = []
    for where, expr in panel_queries(json.loads(DASHBOARD.read_text())):
        if ENGINE_START in expr:
            counted = sorted((m for m in PER_FAILURE if m in expr), key=expr.index)
            assert len(counted) == 1 or (len(counted) == 2 and " / " in expr), \
                f"{where}: no truth known for what it counts ({counted})"
            out.append((where, expr, counted))
    return out


def truth_of(counted: list[str], failures: int) -> float:
    """What the query must give for ``failures`` scripted failures (NaN: no data, a ratio of nothing)."""
    counts = [failures * PER_FAILURE[m] for m in counted]
    if len(counts) == 1:
        return counts[0]
    return counts[0] / counts[1] if counts[1] and counts[0] else math.nan  # the ratio panels hide 0


def grafana(expr: str, **builtins: str) -> str:
    """``expr`` as Grafana sends it: every dashboard variable at "All" (job: "kvobs"), and ``builtins``."""
    values = {v["name"]: ".*" for v in json.loads(DASHBOARD.read_text())["templating"]["list"]}
    return substitute(expr, {**values, "job": "kvobs", "datasource": "prometheus", "__rate_interval": "1m",
                             **builtins})


def total(expr: str) -> str:
    return f"max({expr})" if "_bucket" in expr else f"sum({expr})"


class ScrapedPrometheus(Prometheus):
    """Debian's prometheus scraping the sidecar as the shipped ``kvobs`` job every second, with the shipped
    rule files evaluated every second."""

    def __init__(self, workdir: Path, sidecar_port: int) -> None:
        super().__init__(workdir, [])
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(p) for p in RULE_FILES],
            "scrape_configs": [{"job_name": "kvobs", "static_configs": [
                {"targets": [f"127.0.0.1:{sidecar_port}"], "labels": {"instance": "vllm"}}]}],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?" + urllib.parse.urlencode(params)
        status, _, body = http_get(url)
        payload = json.loads(body)
        assert status == 200 and payload["status"] == "success", payload
        return payload["data"]

    def number(self, expr: str, at: float) -> float:
        result = self.query(expr, at)
        return float(result[0]["value"][1]) if result else math.nan

    def steps(self, expr: str, start: float, end: float, step: int) -> list[float]:
        """A range query's values, every step from ``start`` to ``end`` (Grafana's, on multiples of ``step``)."""
        data = self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=str(step))
        return [float(v) for series in data["result"] for _, v in series["values"]]

    def scraped(self, failures: int) -> None:
        wait_for(lambda: self.query("sum(kvobs_load_failures_total)")
                 and self.value("sum(kvobs_load_failures_total)") == failures, what=f"{failures} failures scraped")

    def wipe(self) -> None:
        """A restart without storage (an emptyDir, a new pod)."""
        self.stop()
        shutil.rmtree(self.workdir / "data")
        self.start()


@pytest.fixture
def scene(tmp_path: Path) -> Iterator[tuple[Path, Sidecar, ScrapedPrometheus]]:
    directory = tmp_path / "kvobs"
    sidecar = Sidecar(directory)
    prometheus = ScrapedPrometheus(tmp_path / "prometheus", sidecar.port)
    try:
        yield directory, sidecar, prometheus
    finally:
        sidecar.stop()
        prometheus.stop()


def pause() -> float:
    """Let every event settle and give a boundary between them, on a multiple of every step (as Grafana
    aligns a range query's steps, so the steps cover exactly the range): the boundary's time."""
    time.sleep(SETTLE_S)
    at = math.ceil(time.time() / max(STEPS)) * max(STEPS)
    time.sleep(at - time.time() + SETTLE_S)
    return at


def check_counts(prometheus: ScrapedPrometheus, start: float, end: float, failures: int, *,
                 steps: bool = True) -> None:
    """Every count query over (``start``, ``end``] gives ``failures`` scripted failures' worth."""
    checked = 0
    for where, expr, counted in count_queries():
        truth = truth_of(counted, failures)
        if "$__range" in expr:
            span = round(end - start)
            got = prometheus.number(total(grafana(expr, __range=f"{span}s", __range_s=str(span))), end)
            # No data is right for nothing to show: a count of 0 that a panel hides, a ratio of nothing.
            assert got == truth or (math.isnan(got) and (truth == 0 or math.isnan(truth))), (where, got, truth)
        elif steps and len(counted) == 1:
            for step in STEPS:  # the steps (t - step, t] from ``start`` to ``end``
                values = prometheus.steps(total(grafana(expr, __interval=f"{step}s", __interval_ms=str(step * 1000))),
                                          start + step, end, step)
                assert all(v >= 0 and v == int(v) for v in values), (where, step, values)
                assert sum(values) == truth, (where, step, values, truth)
        checked += 1
    assert checked >= 7, checked


def test_a_pod_that_starts_in_the_range_with_a_failure_in_its_first_scrape(
        scene: tuple[Path, Sidecar, ScrapedPrometheus]) -> None:
    directory, sidecar, prometheus = scene
    prometheus.start()  # the target is down: the pod is not there yet
    before = pause()
    sidecar.start()  # the pod starts: its sidecar first, then vLLM, which fails at once
    wait_for(lambda: prometheus.query("kvobs_sidecar_engines == 0"), what="the new sidecar scraped")
    engine = ScriptedEngine(directory)
    engine.fail()  # its hello and this failure reach the journal in one flush: the series are born at 1
    prometheus.scraped(1)
    between = pause()
    born = 'min_over_time(kvobs_load_failures_total{cause="coverage_mismatch"}[1m])'
    assert prometheus.number(born, between) == 1, "a scrape showed the engine before its failure"
    engine.restart()  # vLLM restarted in the same pod: a new writer, the sidecar's sums go on
    engine.fail()
    prometheus.scraped(2)
    end = pause()
    engine.close()
    check_counts(prometheus, before, end, 2)
    check_counts(prometheus, between, end, 1)
    assert prometheus.number(f"sum({RULE})", end) == 2


def test_a_sidecar_restart_counts_each_failure_once_and_the_alert_stays_firing(
        scene: tuple[Path, Sidecar, ScrapedPrometheus]) -> None:
    directory, sidecar, prometheus = scene
    sidecar.start()
    engine = ScriptedEngine(directory)
    prometheus.start()
    prometheus.scraped(0)
    before = pause()  # the engine started before the range: only the counters' own values count
    engine.fail()
    prometheus.scraped(1)
    firing = wait_for(lambda: [a for a in prometheus.api("alerts")["alerts"]
                               if a["labels"]["alertname"] == "KvobsLoadFailure" and a["state"] == "firing"],
                      what="KvobsLoadFailure firing")
    sidecar.stop()
    engine.fail()  # while the sidecar is down: in the journal only
    time.sleep(6)  # scrapes fail: the sidecar's series go stale
    sidecar.start()  # from its checkpoint
    prometheus.scraped(2)
    time.sleep(SETTLE_S)
    engine.fail()
    prometheus.scraped(3)
    end = pause()
    engine.close()
    check_counts(prometheus, before, end, 3)
    assert prometheus.number(f"sum({RULE})", end) == 3
    now = [a for a in prometheus.api("alerts")["alerts"]
           if a["labels"]["alertname"] == "KvobsLoadFailure" and a["state"] == "firing"]
    assert {(json.dumps(a["labels"], sort_keys=True), a["activeAt"]) for a in firing} <= \
        {(json.dumps(a["labels"], sort_keys=True), a["activeAt"]) for a in now}, \
        ("the failure alert resolved in the scrape gap and fired again (keep_firing_for?)", firing, now)


def test_a_prometheus_restarted_without_storage_neither_recounts_nor_misses(
        scene: tuple[Path, Sidecar, ScrapedPrometheus]) -> None:
    directory, sidecar, prometheus = scene
    prometheus.start()
    before = pause()
    sidecar.start()
    engine = ScriptedEngine(directory)
    prometheus.scraped(0)
    engine.fail()
    prometheus.scraped(1)
    between = pause()  # the engine is older than this range; its first failure is outside it
    prometheus.wipe()
    prometheus.scraped(1)
    time.sleep(SETTLE_S)
    engine.fail()
    prometheus.scraped(2)
    end = pause()
    engine.close()
    check_counts(prometheus, between, end, 1)  # the old failure, back at the first scrape, is not new
    # From before the engine started: both, from the engine's start time (the bars cannot show the
    # first: Prometheus lost the samples that had it).
    check_counts(prometheus, before, end, 2, steps=False)
    assert prometheus.number(f"sum({RULE})", end) == 2  # both in the last hour: the engine started in it
