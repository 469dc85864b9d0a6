"""Dashboards and rules against a real Prometheus fed by a real workload.

vLLM 0.33.0's real managers (CPU and tiering) run under kvobs with ``dir=`` a temporary directory;
a real sidecar (``kvobs serve``) exports the result, each engine's series labelled with
``model_name`` and ``engine`` as vLLM labels its own; Debian's Prometheus scrapes it with the
``kvobs`` job of the shipped docker/prometheus/prometheus.yml (its ``instance`` label) and loads the
shipped rule files. Then every query of every dashboard panel, with its variables substituted as
Grafana would, must return data from Prometheus's HTTP API. And kvobs's evictions, load failures and near
misses come from either metrics path (the sidecar, or vLLM's /metrics with the kvobs option vllm_metrics),
never from both added.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

import kvobs
from tests.support.dashboards import panel_queries, substitute
from tests.support.services import ROOT, Prometheus, Sidecar, free_port, http_get, wait_for
from tests.support.vllm_env import (
    cpu_extra,
    create_manager,
    evicted_after_lookup_then_coverage_mismatch,
    key,
    tiering_extra,
)

pytestmark = pytest.mark.tools

DASHBOARDS = sorted((ROOT / "dashboards").glob("*.json"))
RULES = ROOT / "dashboards" / "rules"
RULE_FILES = sorted(RULES.glob("*.yaml"))
PROMETHEUS_CONFIG = ROOT / "docker" / "prometheus" / "prometheus.yml"
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
CAUSES_PRODUCED = {"evicted_after_lookup", "coverage_mismatch", "reset_after_lookup", "store_failed_after_lookup"}
# vLLM's own vllm:kv_offload_* series come from vllm_metrics_process.py: the real connector
# scheduler's stats recorded by vLLM's own KVConnectorProm (the API server itself needs a GPU).
VLLM_METRICS = "tests.support.vllm_metrics_process"  # run as a module from the repository root


def served_model() -> str:
    """The model_name vllm_metrics_process.py labels vLLM's series with (its engine is "0")."""
    source = (ROOT / "tests" / "support" / "vllm_metrics_process.py").read_text()
    match = re.search(r'^MODEL = "([^"]+)"$', source, re.M)
    assert match is not None
    return match[1]


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    assert binary, "promtool is missing: `make prometheus` installs Debian's prometheus (which ships it)"
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_promtool_checks_the_rules_and_config() -> None:
    checked = promtool("check", "rules", *map(str, RULE_FILES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.count("SUCCESS") == len(RULE_FILES) == 2
    config = promtool("check", "config", "--syntax-only", str(PROMETHEUS_CONFIG))
    assert config.returncode == 0, config.stdout + config.stderr


def test_promtool_unit_tests_pass() -> None:
    tests = sorted((RULES / "tests").glob("*.yaml"))
    assert tests
    result = promtool("test", "rules", *map(str, tests))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(tests)


def scrape_config(sidecar_port: int | None, vllm_port: int) -> dict[str, Any]:
    """The shipped ``kvobs`` and ``vllm`` jobs (labels, relabelling) pointed at the test's targets, every
    second; without ``sidecar_port``, the ``vllm`` job alone (vLLM's /metrics the only path)."""
    shipped = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    jobs = {j["job_name"]: j for j in shipped["scrape_configs"]}
    ports = {"kvobs": sidecar_port, "vllm": vllm_port}
    for name, port in ports.items():
        (static,) = jobs[name]["static_configs"]
        static["targets"] = [f"127.0.0.1:{port}"]
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(p) for p in RULE_FILES],
        "scrape_configs": [jobs[name] for name, port in ports.items() if port is not None],
    }


def start_vllm_metrics(kvobs_dir: Path | None = None,
                       vllm_metrics: bool = False) -> tuple[subprocess.Popen[bytes], int]:
    """vllm_metrics_process.py; with ``kvobs_dir`` its kvobs journals there (for a sidecar), with
    ``vllm_metrics`` kvobs's counters join vLLM's own series (the kvobs option vllm_metrics)."""
    port = free_port()
    env = {**os.environ, "KVOBS_VLLM_METRICS": "1" if vllm_metrics else "0"}
    proc = subprocess.Popen([sys.executable, "-m", VLLM_METRICS, str(port), *([str(kvobs_dir)] if kvobs_dir else [])],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: b"vllm:kv_offload_allocation_failure_total{" in http_get(f"http://127.0.0.1:{port}/metrics")[2],
                 timeout=90, what="vLLM's offload metrics")
    except AssertionError:
        proc.kill()
        raise AssertionError(proc.stderr.read().decode()[-3000:] if proc.stderr else "no stderr") from None
    return proc, port


class ShippedPrometheus(Prometheus):
    """Debian's prometheus with the shipped scrape job and rule files."""

    def __init__(self, workdir: Path, config: dict[str, Any]) -> None:
        super().__init__(workdir, [])
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))


def run_workload(cpu: Any, tier: Any) -> None:
    """Evictions of every reason, near misses, and failed loads of four causes, on two engines."""
    writer, victim, reset_victim = ReqContext("writer"), ReqContext("req-a"), ReqContext("req-r")
    for context in (writer, victim, reset_victim):
        cpu.on_new_request(context)
    evicted_after_lookup_then_coverage_mismatch(cpu, writer, victim, pause_s=0.01)  # and a near miss
    reset_victim.set_offload_key_position(key(503, group=1), 48)
    assert cpu.lookup(key(503, group=1), reset_victim) is LookupResult.HIT
    cpu.reset_cache()
    with pytest.raises(AssertionError, match="cause: reset_after_lookup"):
        cpu.prepare_load([key(503, group=1)], reset_victim)

    s1, s2, a = ReqContext("store-1"), ReqContext("store-2"), ReqContext("req-t")
    for context in (s1, s2, a):
        tier.on_new_request(context)
    for k, context in ((key(1), s1), (key(2), s2)):  # key(1) cascades, then leaves the primary tier
        tier.prepare_store([k], context)
        tier.complete_store([k], context)
        tier.on_schedule_end(END)
    a.set_offload_key_position(key(1), 16)
    assert tier.lookup(key(1), a) is LookupResult.HIT_PENDING  # a promotion from the secondary tier
    del tier.inner.secondary_tiers[0].chunks[key(1)]  # its read fails: the promotion's store fails
    tier.on_schedule_end(END)
    tier.on_schedule_end(END)
    with pytest.raises(AssertionError, match="cause: store_failed_after_lookup"):
        tier.prepare_load([key(1)], a)


@pytest.mark.slow
def test_every_dashboard_query_returns_data_after_a_real_workload(tmp_path: Path, managers: list[Any]) -> None:
    directory = tmp_path / "kvobs"
    directory.mkdir()
    vllm_metrics, vllm_port = start_vllm_metrics()
    sidecar = Sidecar(directory).start()
    config = scrape_config(sidecar.port, vllm_port)
    labels = config["scrape_configs"][0]["static_configs"][0]["labels"]
    assert "model" not in labels and "model_name" not in labels  # the sidecar carries it now
    model, instance = served_model(), labels["instance"]
    prometheus = ShippedPrometheus(tmp_path / "prom", config).start()
    started = time.monotonic()
    try:
        # vLLM's engine indexes and served model name, as the plugin reads them under vLLM.
        cpu = kvobs.observe(create_manager(cpu_extra(4)), dir=str(directory), engine="0", model_name=model)
        tier = kvobs.observe(create_manager(tiering_extra(1)), dir=str(directory), engine="1", model_name=model)
        managers.extend((cpu, tier))
        # Prometheus sees both engines' zeros before the workload, so rates and increases see it happen.
        wait_for(lambda: len(prometheus.query('kvobs_load_failures_total{cause="unknown"}')) == 2,
                 what="both engines scraped")
        # When Prometheus took that scrape of the zeros (its own clock, in ms): a count reaches back exactly there.
        zeros = prometheus.query('timestamp(kvobs_load_failures_total{cause="unknown"})')
        zeros_at = max(float(r["value"][1]) for r in zeros)
        run_workload(cpu, tier)
        wait_for(lambda: prometheus.value("sum(kvobs_load_failures_total)") == len(CAUSES_PRODUCED),
                 what="the four failures scraped")
        wait_for(lambda: prometheus.value('sum(kvobs_evicted_chunks_total{reason="store_failed"})') == 1,
                 what="the failed store scraped")

        # Several scrapes of vLLM's series, so each of their rates has samples in the window below.
        wait_for(lambda: (prometheus.value('min(count_over_time({__name__=~"vllm[:_]kv_offload_'
                                           'tiering_cascade_job_failures_total"}[1m]))') or 0) >= 6,
                 what="six scrapes of vLLM's offload series")

        # The labels the dashboards rely on came through the shipped scrape config.
        (build,) = prometheus.query('kvobs_build_info{engine="0"}')
        assert build["metric"]["model_name"] == model and build["metric"]["instance"] == instance
        assert build["metric"]["job"] == "kvobs"
        # kvobs's and vLLM's series of engine 0 join on vLLM's own labels.
        joined = prometheus.query('kvobs_build_info * on (model_name, engine) group_left '
                                  'max by (model_name, engine) ({__name__=~"vllm[:_]kv_offload_cpu_cache_usage_perc"})')
        assert [r["metric"]["engine"] for r in joined] == ["0"]
        # The sidecar's own series carry neither label; no engine series is the sidecar's.
        assert all(set(r["metric"]).isdisjoint({"model_name", "engine"})
                   for r in prometheus.query('{__name__=~"kvobs_sidecar_.*"}'))
        assert {r["metric"]["engine"] for r in prometheus.query("kvobs_build_info")} == {"0", "1"}

        # Recording rules evaluate (every 1 s here), alerting rules fire on the real series.
        recorded = [r["record"] for g in yaml.safe_load((RULES / "kvobs-recording.yaml").read_text())["groups"]
                    for r in g["rules"]]
        for name in recorded:
            wait_for(lambda name=name: prometheus.query(name), what=f"recording rule {name}")
        wait_for(lambda: prometheus.value("sum(engine_cause:kvobs_load_failures:increase1h)") >= len(CAUSES_PRODUCED),
                 what="the recorded increase of load failures")
        # One KvobsLoadFailure an engine, whatever its causes; its description names every cause.
        wait_for(lambda: sorted(a["metric"]["engine"] for a in prometheus.query('ALERTS{alertname="KvobsLoadFailure"}'))
                 == ["0", "1"], what="KvobsLoadFailure for each engine")
        alerts = json.loads(http_get(f"http://127.0.0.1:{prometheus.port}/api/v1/alerts")[2])["data"]["alerts"]
        described = " ".join(a["annotations"]["description"] for a in alerts
                             if a["labels"]["alertname"] == "KvobsLoadFailure")
        assert all(cause in described for cause in CAUSES_PRODUCED), described
        assert prometheus.query('ALERTS{alertname=~"KvobsSidecarDown|KvobsSidecarAbsent"}') == []

        # Grafana's $__rate_interval is max(4 x scrape interval, $__interval + scrape interval); the
        # window here is that at least, and long enough to hold the whole workload.
        window = max(4, math.ceil(time.monotonic() - started) + 2)
        # A count reads the value one step (or the range) earlier: evaluated at a chosen instant, it reaches
        # back exactly to the zeros' scrape, so the workload's failures are inside it and the series existed.
        # (A window in whole seconds from the test's clock could end up to a scrape after the zeros, where on a
        # fast run the failures already were: seen in CI, the annotation read nothing.)
        # cluster: "All" (this Prometheus adds no cluster label); job: single-select, the sidecar's job.
        # vllm_metrics_process.py runs one vLLM engine ("0"): with engine "1" only vLLM's panels may be empty.
        everything = {"cluster": ".*", "namespace": ".*", "job": "kvobs"}
        variable_sets = [
            {**everything, "model_name": ".*", "instance": ".*", "engine": ".*"},  # "All"
            {**everything, "model_name": model, "instance": instance, "engine": "0"},
            {**everything, "model_name": model, "instance": instance, "engine": "1"},
        ]
        checked, vllm_queries, empty = 0, 0, []
        for path in DASHBOARDS:
            dashboard = json.loads(path.read_text())
            for variables in variable_sets:
                values = {**variables, "datasource": "", "__rate_interval": f"{window}s"}
                for var in dashboard["templating"]["list"][1:]:  # variable queries: label_values(metric, label)
                    match = re.fullmatch(r"label_values\((.+), (\w+)\)", var["query"])
                    assert match is not None
                    found = prometheus.query(f"group by ({match[2]}) ({substitute(match[1], values)})")
                    assert {r["metric"].get(match[2]) for r in found} >= {variables[var["name"]]} - {".*"}, var
                    if var["name"] not in ("cluster", "namespace"):  # labels a single compose Prometheus lacks
                        assert all(r["metric"].get(match[2]) for r in found), var  # no empty value offered
                    assert found, var["name"]
                for where, expr in panel_queries(dashboard):
                    # Evaluated now, not when the loop began: on a loaded machine the loop takes seconds.
                    at = round(time.time(), 3)
                    span_ms = round((at - zeros_at) * 1000)
                    counts = {"__range": f"{span_ms}ms", "__interval": f"{span_ms}ms",
                              "__range_s": str(span_ms // 1000), "__interval_ms": str(span_ms)}
                    query = substitute(expr, {**values, **counts})
                    vllm_queries += "vllm[:_]kv_offload" in query
                    result = prometheus.query(query, at)
                    checked += 1
                    if not result:
                        if "vllm[:_]" in query and variables["engine"] == "1":
                            continue  # no vLLM engine 1 in vllm_metrics_process.py
                        if any(name in query for name in CONDITIONAL_VLLM):
                            continue
                        empty.append(f"{path.name} {where} {variables}: {query}")
                    elif variables["engine"] == ".*" and all(math.isnan(float(r["value"][1])) for r in result):
                        empty.append(f"{path.name} {where}: only NaN: {query}")
        assert empty == []
        assert checked >= 35 * len(variable_sets) and vllm_queries >= 10 * len(variable_sets), (checked, vllm_queries)
    finally:
        prometheus.stop()
        sidecar.stop()
        vllm_metrics.terminate()
        vllm_metrics.wait(timeout=15)


# kvobs's three counters on either metrics path (issue 15): the sidecar's kvobs_<name> or, with the kvobs
# option vllm_metrics, vLLM's vllm:kv_offload_kvobs_<name> (kvobs/vllm/vllm_metrics.py).
BOTH_PATHS = r"(?:evicted_chunks_total|load_failures_total|hits_evicted_before_load_total)"
VLLM_COUNTER = r"\{__name__=~\"vllm\[:_\]kv_offload_kvobs_" + BOTH_PATHS + r"\", [^}]*\}"
VLLM_READ = r"(?:rate\(" + VLLM_COUNTER + r"\[[^\]]+\]\)|clamp_min\((" + VLLM_COUNTER + r") - \2 offset \S+, 0\))"
EITHER_OR = re.compile(r"sum by \(([^)]*)\) \(" + VLLM_READ + r"\)")
"""vLLM's side of a two-path read (issue 20: it gives way, "unless on" the engine, to the sidecar's)."""
CONDITIONAL_VLLM = ("kv_offload_stores_skipped_total", "kv_offload_tiering_backpressure_",
                    "kv_offload_tiering_promotion_latency_seconds", "prompt_tokens_cached_by_source_total")
"""vLLM's series that exist only on some releases or configurations (the panels' descriptions say which):
stores skipped with the CPU spec's store_threshold >= 2, back-pressure with a back-pressure policy (0.31+),
promotion latency on 0.33+ after a promotion, prompt tokens cached by source from the API server's stat logger
(0.32+); vllm_metrics_process.py configures none of them."""
COUNTER_PANELS = {"Load failures in range", "Near misses /s", "Load failures by cause", "Near misses by reason",
                  "Eviction rate by reason", "Near misses and failures per engine"}


def query_at(prometheus: Prometheus, expr: str, at: float) -> dict[str, float]:
    """An instant query at ``at``: {labels: value}."""
    return {json.dumps(r["metric"], sort_keys=True): float(r["value"][1]) for r in prometheus.query(expr, at)}


def only_path(expr: str, path: str) -> str:
    """The expression with the other path's counters renamed to series that do not exist (for vLLM's path,
    also the sidecar's build info its read gives way to)."""
    if path == "sidecar":
        return expr.replace("vllm[:_]kv_offload_kvobs_", "vllm[:_]kv_offload_no_such_")
    expr = re.sub(r"(unless on \([^)]*\) )kvobs_build_info\{", r"\1no_such_kvobs_build_info{", expr)
    return re.sub(r"\bkvobs_(" + BOTH_PATHS + r")\{", r"no_such_kvobs_\1{", expr)


def series_counted(expr: str) -> str:
    """Each raw series a rate/increase reads counted as 1 (whatever it counted): sums then count series,
    so a query adding both paths' series of one engine shows even where both counted nothing."""
    expr = re.sub(r"\bclamp_min\(((?:kvobs_\w+)?\{[^}]*\}) - \1 offset \S+, 0\)", r"(\1 ^ 0)", expr)
    return re.sub(r"\b(?:rate|increase)\(((?:kvobs_\w+)?\{[^}]*\}\[[^\]]+\])\)", r"(count_over_time(\1) ^ 0)", expr)


def grafana_variables(prometheus: Prometheus, dashboard: dict[str, Any], chosen: dict[str, str]) -> dict[str, str]:
    """The variables as Grafana fills them from this Prometheus: the chosen value where it is offered,
    All (".*") for an includeAll variable otherwise, the first value else ("" when none, as Grafana's
    empty option)."""
    values = {"datasource": ""}
    for var in dashboard["templating"]["list"][1:]:
        match = re.fullmatch(r"label_values\((.+), (\w+)\)", var["query"])
        assert match is not None
        found = sorted(r["metric"].get(match[2], "")
                       for r in prometheus.query(f"group by ({match[2]}) ({substitute(match[1], values)})"))
        want = chosen.get(var["name"], ".*")
        if want in found or (want == ".*" and var["includeAll"]):
            values[var["name"]] = want
        else:
            assert not var["includeAll"], (var["name"], want, found)
            values[var["name"]] = found[0] if found else ""
    return values


@pytest.mark.slow
def test_kvobs_counters_from_either_path_without_double_counting(tmp_path: Path) -> None:
    """Issue 15: one engine (vllm_metrics_process.py) journals for a real sidecar and, with the kvobs option
    vllm_metrics, puts the same counters on vLLM's /metrics. A Prometheus scraping vLLM alone fills the
    variables and the counter panels; one scraping both gets from each counter query exactly what the
    sidecar's series alone give, where vLLM's alone cover the same engine and series."""
    directory = tmp_path / "kvobs"
    directory.mkdir()
    sidecar = Sidecar(directory).start()
    vllm_metrics, vllm_port = start_vllm_metrics(directory, vllm_metrics=True)
    vllm_only = ShippedPrometheus(tmp_path / "vllm-only", scrape_config(None, vllm_port)).start()
    both = ShippedPrometheus(tmp_path / "both", scrape_config(sidecar.port, vllm_port)).start()
    model, window = served_model(), 20
    dashboard = json.loads((ROOT / "dashboards" / "kvobs-offload.json").read_text())
    try:
        vllm_evictions = '{__name__=~"vllm[:_]kv_offload_kvobs_evicted_chunks_total", reason="capacity"}'
        for prometheus, selector in ((vllm_only, vllm_evictions), (both, vllm_evictions),
                                     (both, 'kvobs_evicted_chunks_total{reason="capacity"}')):
            wait_for(lambda p=prometheus, s=selector: (p.value(f"min(count_over_time({s}[{window}s]))") or 0) >= 8,
                     timeout=90, what=f"eight scrapes of {selector}")
        assert vllm_only.query('{__name__=~"kvobs_.*"}') == []  # vLLM's /metrics is the only path there
        instance = scrape_config(None, vllm_port)["scrape_configs"][0]["static_configs"][0]["labels"]["instance"]
        rates = {"__rate_interval": f"{window}s", "__range": "5s", "__interval": "5s",  # counts: inside 8 scrapes
                 "__range_s": "5", "__interval_ms": "5000"}

        # (a) vLLM's path alone: the variables offer its model, instance and engine (no sidecar job), and
        # every query of the counters returns data, for All and for that engine.
        for chosen in ({}, {"model_name": model, "instance": instance, "engine": "0"}):
            values = {**grafana_variables(vllm_only, dashboard, chosen), **rates}
            assert values["job"] == "" and values["cluster"] == ".*"
            assert [values[n] for n in ("model_name", "instance", "engine")] == [
                chosen.get(n, ".*") for n in ("model_name", "instance", "engine")]
            counter_panels, empty = set(), []
            for panel in dashboard["panels"]:
                for target in panel.get("targets", []):
                    query = substitute(target["expr"], values)
                    result = vllm_only.query(query)
                    if "vllm[:_]kv_offload_kvobs_" in query:
                        counter_panels.add(panel["title"])
                        if not result:
                            empty.append(f"{panel['title']} {target['refId']}: {query}")
                        # Each engine's either-or part carries vLLM's model_name and engine.
                        for part in EITHER_OR.finditer(query):
                            engines = {(r["metric"].get("model_name"), r["metric"].get("engine"))
                                       for r in vllm_only.query(part[0])}
                            assert engines == {(model, "0")}, part[0]
                    elif "vllm[:_]" in query and not re.search(r"\bkvobs_", query):  # vLLM's own series
                        assert result or any(name in query for name in CONDITIONAL_VLLM), (
                            f"vLLM's own panel {panel['title']!r} is empty: {query}")
                    elif not result:  # the panels vLLM's /metrics cannot feed say so
                        assert re.search(r"needs? the sidecar", panel["description"], re.I), panel["title"]
            assert empty == []
            assert counter_panels >= COUNTER_PANELS, COUNTER_PANELS - counter_panels
            evicted = next(t["expr"] for p in dashboard["panels"] if p["title"] == "Eviction rate by reason"
                           for t in p["targets"] if t["refId"] == "A")
            assert sum(float(r["value"][1]) for r in vllm_only.query(substitute(evicted, values))) > 0

        # (b) Both paths, the same engine: each query gives what the sidecar's series alone give, never the
        # sum. Counting series (series_counted) catches doubling where both paths counted nothing.
        values = {**grafana_variables(both, dashboard, {"job": "kvobs"}), **rates}
        assert values["job"] == "kvobs"
        queries = [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]
        queries += [(a["name"], a["expr"]) for a in dashboard["annotations"]["list"] if "expr" in a]
        compared = 0
        for where, expr in queries:
            query = substitute(expr, values)
            if "vllm[:_]kv_offload_kvobs_" not in query:
                continue
            for variant in (query, series_counted(query)):
                at = time.time() - 1
                read = query_at(both, variant, at)
                sidecar_alone = query_at(both, only_path(variant, "sidecar"), at)
                assert read == sidecar_alone, (where, variant, read, sidecar_alone)
                if variant != query:  # vLLM's series alone cover the same engines and series: an overlap
                    assert query_at(both, only_path(variant, "vllm"), at) == sidecar_alone, (where, variant)
                    assert sidecar_alone and all(v > 0 for v in sidecar_alone.values()), (where, variant)
                compared += 1
        assert compared >= 2 * (len(COUNTER_PANELS) + 1)  # and the annotation
        # The evictions counted on both paths (so adding them would show): both rates positive.
        evicted_now = substitute(evicted, values)
        at = time.time() - 1
        assert sum(query_at(both, only_path(evicted_now, "sidecar"), at).values()) > 0
        assert sum(query_at(both, only_path(evicted_now, "vllm"), at).values()) > 0
    finally:
        both.stop()
        vllm_only.stop()
        vllm_metrics.terminate()
        vllm_metrics.wait(timeout=15)
        sidecar.stop()
