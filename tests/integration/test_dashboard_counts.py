"""Issue 20: every dashboard query that counts shows one failure once, whatever the scrape set-up.

Each query of the shipped dashboard, its variables substituted as Grafana would, runs in
``promtool test rules`` (Debian's promtool, Prometheus's own PromQL engine) against one failed load
scraped every 15 s through both metrics paths at once, with the two paths' ``instance`` labels
*different* (the sidecar's pod name, vLLM's address): what a PodMonitor of the sidecar next to the
operator's own vLLM scrape gives. Count panels are evaluated at every step of a Grafana range query
(step = ``$__interval``, 1 m and the 15 s scrape interval itself): exactly one step shows the
failure, with 1. Instant counts over ``$__range`` read 1; the two-path rates read one path's rate.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.dashboards import panel_queries, substitute

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "dashboards" / "kvobs-offload.json"
SCRAPE_S = 15
FAILED_AT_S = 22 * 60 + 45  # the first scrape that shows the failure
SAMPLES = 80 * 60 // SCRAPE_S
SIDECAR = {"job": "kvobs", "namespace": "llm", "instance": "vllm-abc", "model_name": "m", "engine": "0"}
VLLM = {"job": "vllm", "namespace": "llm", "instance": "10.0.0.5:8000", "model_name": "m", "engine": "0"}


def series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    body = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{body}}}", "values": values}


def step_at(after: int) -> str:
    """promtool values: 0 for every scrape before FAILED_AT_S, then ``after``."""
    before = FAILED_AT_S // SCRAPE_S
    return f"0x{before - 1} {after}x{SAMPLES - before - 1}"


def one_failure() -> list[dict[str, str]]:
    """One failed load (cause evicted_after_lookup, one missing chunk of group 0, evicted 0.3 s before;
    recomputed by survive mode, with an alarm), one capacity eviction of a chunk resident for 2 s, on
    both paths; steady evictions and near misses (1 a second) on both paths; the sidecar's build info."""
    inputs = [series("kvobs_build_info", {**SIDECAR, "version": "0.1.0", "vllm_version": "0.33.0",
                                          "hot_path": "compiled"}, f"1x{SAMPLES - 1}")]
    for name, labels in (("kvobs_load_failures_total", SIDECAR),
                         ("vllm:kv_offload_kvobs_load_failures_total", VLLM)):
        inputs.append(series(name, {**labels, "cause": "evicted_after_lookup"}, step_at(1)))
        inputs.append(series(name, {**labels, "cause": "coverage_mismatch"}, f"0x{SAMPLES - 1}"))
        for counter in ("evicted_chunks_total", "hits_evicted_before_load_total"):
            full = f"kvobs_{counter}" if labels is SIDECAR else f"vllm:kv_offload_kvobs_{counter}"
            inputs.append(series(full, {**labels, "reason": "capacity"}, f"0+{SCRAPE_S}x{SAMPLES - 1}"))
    inputs.append(series("kvobs_missing_chunks_total", {**SIDECAR, "cause": "evicted_after_lookup", "group": "0"},
                         step_at(1)))
    # Survive mode's counters (sidecar only): that failure recomputed, and the alarm it raised.
    for counter in ("kvobs_recomputed_loads_total", "kvobs_recompute_alarms_total"):
        inputs.append(series(counter, SIDECAR, step_at(1)))
    for le, hit in (("0.1", 0), ("0.5", 1), ("+Inf", 1)):
        inputs.append(series("kvobs_missing_chunk_eviction_age_seconds_bucket", {**SIDECAR, "group": "0", "le": le},
                             step_at(hit)))
    for le, hit in (("1", 0), ("5", 1), ("+Inf", 1)):
        inputs.append(series("kvobs_chunk_residency_seconds_bucket", {**SIDECAR, "reason": "capacity", "le": le},
                             step_at(hit)))
    return inputs


def grafana(expr: str, step: str) -> str:
    values = {"datasource": "", "cluster": ".*", "job": "kvobs", "model_name": ".*", "instance": ".*", "engine": ".*",
              "__interval": step, "__rate_interval": "1m", "__range": "1h"}
    return substitute(expr, values)


def total(expr: str) -> str:
    """One number per evaluation: the sum of what the panel draws (a histogram's +Inf bucket counts each
    event once, its lower buckets again: the largest bucket is the count)."""
    return f"max({expr})" if "_bucket" in expr else f"sum({expr})"


def counted_once(expr: str, step_s: int) -> list[dict[str, Any]]:
    """The panel at every step from 20 to 26 minutes: the failure in exactly one step, as 1."""
    failed_step = -(-FAILED_AT_S // step_s) * step_s  # the first step whose window holds the failure's scrape
    cases = []
    for at in range(20 * 60, 26 * 60 + 1, step_s):
        value = 1 if at == failed_step else 0
        filtered = re.search(r"\)\s*>\s*0\s*$", expr) is not None  # the annotation draws only what counted
        samples = [] if (filtered and value == 0) else [{"labels": "{}", "value": value}]
        cases.append({"expr": total(grafana(expr, f"{step_s}s")), "eval_time": f"{at}s", "exp_samples": samples})
    return cases


def counting_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(where, expr) for where, expr in panel_queries(dashboard) if "offset $__" in expr]


def test_counting_panels_use_the_step_and_nothing_counts_with_increase() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [expr for _, expr in panel_queries(dashboard)]
    # increase() over a window wider than the step (as $__rate_interval is) counts an event in several steps.
    assert not any("increase(" in e for e in exprs)
    where = {re.search(r"'(.*)'", w)[1] for w, _ in counting_queries()}  # type: ignore[index]
    assert {"Load failures in range", "Load failures by cause", "Missing chunks by group",
            "Chunk residency (capacity evictions)", "Eviction age at failure (in range)", "Load failures"} <= where


@pytest.mark.tools
def test_one_failure_is_counted_once_in_every_counting_query(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: `make prometheus` installs Debian's prometheus (which ships it)"
    tests: list[dict[str, Any]] = []
    counted = 0
    for _, expr in counting_queries():
        if "offset $__range" in expr:  # an instant query over the dashboard's range: 1 at its end
            tests.append({"expr": total(grafana(expr, "1m")), "eval_time": "60m",
                          "exp_samples": [{"labels": "{}", "value": 1}]})
        else:
            for step_s in (60, SCRAPE_S):  # a 1 m step, and the step Grafana's minimum allows: the scrape
                tests.extend(counted_once(expr, step_s))
        counted += 1
    # The two-path rates (evictions, near misses): one path's 1/s, not both paths' 2/s.
    dashboard = json.loads(DASHBOARD.read_text())
    rates = 0
    for _, expr in panel_queries(dashboard):
        if re.search(r"rate\(kvobs_(?:evicted_chunks|hits_evicted_before_load)_total\{", expr) and "unless" in expr:
            tests.append({"expr": f"sum({grafana(expr, '1m')})", "eval_time": "40m",
                          "exp_samples": [{"labels": "{}", "value": 1}]})
            rates += 1
    assert counted >= 6 and rates >= 3, (counted, rates)
    spec = {"rule_files": [], "evaluation_interval": "15s",
            "tests": [{"interval": f"{SCRAPE_S}s", "input_series": one_failure(), "promql_expr_test": tests}]}
    path = tmp_path / "counts-test.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    result = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "SUCCESS" in result.stdout, (result.stdout + result.stderr)[-6000:]
