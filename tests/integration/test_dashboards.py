"""Dashboards and rules against a real Prometheus fed by a real workload.

vLLM 0.33.0's real managers (CPU and tiering) run under kvobs with ``dir=`` a temporary directory;
a real sidecar (``kvobs serve``) exports the result, each engine's series labelled with
``model_name`` and ``engine`` as vLLM labels its own; Debian's Prometheus scrapes it with the
``kvobs`` job of the shipped docker/prometheus/prometheus.yml (its ``instance`` label) and loads the
shipped rule files. Then every query of every dashboard panel, with its variables substituted as
Grafana would, must return data from Prometheus's HTTP API.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from services import ROOT, Prometheus, Sidecar, free_port, http_get, wait_for
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext
from vllm_env import cpu_extra, create_manager, evicted_after_lookup_then_coverage_mismatch, key, tiering_extra

import kvobs

DASHBOARDS = sorted((ROOT / "dashboards").glob("*.json"))
RULES = ROOT / "dashboards" / "rules"
RULE_FILES = sorted(RULES.glob("*.yaml"))
PROMETHEUS_CONFIG = ROOT / "docker" / "prometheus" / "prometheus.yml"
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
CAUSES_PRODUCED = {"evicted_after_lookup", "coverage_mismatch", "reset_after_lookup", "store_failed_after_lookup"}
# vLLM's own vllm:kv_offload_* series come from vllm_metrics_process.py: the real connector
# scheduler's stats recorded by vLLM's own KVConnectorProm (the API server itself needs a GPU).
VLLM_METRICS = Path(__file__).parent / "vllm_metrics_process.py"


def served_model() -> str:
    """The model_name vllm_metrics_process.py labels vLLM's series with (its engine is "0")."""
    match = re.search(r'^MODEL = "([^"]+)"$', VLLM_METRICS.read_text(), re.M)
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


def scrape_config(sidecar_port: int, vllm_port: int) -> dict[str, Any]:
    """The shipped ``kvobs`` and ``vllm`` jobs (labels, relabelling) pointed at the test's targets, every second."""
    shipped = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    jobs = {j["job_name"]: j for j in shipped["scrape_configs"]}
    for name, port in (("kvobs", sidecar_port), ("vllm", vllm_port)):
        (static,) = jobs[name]["static_configs"]
        static["targets"] = [f"127.0.0.1:{port}"]
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(p) for p in RULE_FILES],
        "scrape_configs": [jobs["kvobs"], jobs["vllm"]],
    }


def start_vllm_metrics() -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(VLLM_METRICS), str(port)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
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


def panel_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, expr) for every panel target and annotation query."""
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            for target in inner.get("targets", []):
                yield f"panel {inner['title']!r} {target['refId']}", target["expr"]
    for annotation in dashboard["annotations"]["list"]:
        if "expr" in annotation:
            yield f"annotation {annotation['name']!r}", annotation["expr"]


def substitute(expr: str, values: dict[str, str]) -> str:
    """Grafana's interpolation: $var, ${var} and [[var]] forms."""
    out = re.sub(r"\$\{(\w+)\}|\$(\w+)|\[\[(\w+)\]\]", lambda m: values[m.group(1) or m.group(2) or m.group(3)], expr)
    assert "$" not in out, out
    return out


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
        firing = wait_for(
            lambda: {a["metric"]["cause"] for a in prometheus.query('ALERTS{alertname="KvobsLoadFailure"}')}
            == CAUSES_PRODUCED,
            what="KvobsLoadFailure for each cause",
        )
        assert firing
        assert prometheus.query('ALERTS{alertname=~"KvobsSidecarDown|KvobsSidecarAbsent"}') == []

        # Grafana's $__rate_interval is max(4 x scrape interval, $__interval + scrape interval); the
        # window here is that at least, and long enough to hold the whole workload.
        window = max(4, math.ceil(time.monotonic() - started) + 2)
        # cluster: "All" (this Prometheus adds no cluster label); job: single-select, the sidecar's job.
        # vllm_metrics_process.py runs one vLLM engine ("0"): with engine "1" only vLLM's panels may be empty.
        everything = {"cluster": ".*", "job": "kvobs"}
        variable_sets = [
            {**everything, "model_name": ".*", "instance": ".*", "engine": ".*"},  # "All"
            {**everything, "model_name": model, "instance": instance, "engine": "0"},
            {**everything, "model_name": model, "instance": instance, "engine": "1"},
        ]
        checked, vllm_queries, empty = 0, 0, []
        for path in DASHBOARDS:
            dashboard = json.loads(path.read_text())
            for variables in variable_sets:
                values = {**variables, "datasource": "", "__rate_interval": f"{window}s", "__range": f"{window}s"}
                for var in dashboard["templating"]["list"][1:]:  # variable queries: label_values(metric, label)
                    match = re.fullmatch(r"label_values\((.+), (\w+)\)", var["query"])
                    assert match is not None
                    found = prometheus.query(f"group by ({match[2]}) ({substitute(match[1], values)})")
                    assert {r["metric"].get(match[2]) for r in found} >= {variables[var["name"]]} - {".*"}, var
                    if var["name"] != "cluster":
                        assert all(r["metric"].get(match[2]) for r in found), var  # no empty value offered
                    assert found, var["name"]
                for where, expr in panel_queries(dashboard):
                    query = substitute(expr, values)
                    vllm_queries += "vllm[:_]kv_offload" in query
                    result = prometheus.query(query)
                    checked += 1
                    if not result:
                        if "vllm[:_]" in query and variables["engine"] == "1":
                            continue  # no vLLM engine 1 in vllm_metrics_process.py
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
