"""Every dashboard count shows each failure once, at every step and over every range, for series that
start, stay idle for days or are already non-zero when Prometheus first sees them (issues 20 and 29).

The count queries of the shipped dashboard (the forms of dashboards/promql.py: they read
``kvobs_engine_start_timestamp_seconds``), their variables substituted as Grafana would, run in
``promtool test rules`` (Debian's promtool, Prometheus's own PromQL engine) against scripted series:

* one failed load scraped every 15 s through both metrics paths at once, the two paths' ``instance``
  labels different (a PodMonitor of the sidecar next to the operator's own vLLM scrape): at every step
  of a Grafana range query (1 m, and the 15 s scrape interval itself) exactly one step shows it, with
  1; over ``$__range`` it reads 1; the two-path rates read one path's rate;
* ranges real time cannot reach (tests/integration/test_operator_scenarios.py has the restarts through a
  real scraping Prometheus): an engine idle for six days, a counter already at 5 at the first sample
  Prometheus has (restarted without storage, or a sidecar that came up late), an engine born with its
  failure in its first scrape; each over ranges that hold its start or not, and the ``increase1h``
  recording rule of the shipped rules.
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

from dashboards.promql import ENGINE_START, SIDECAR_POLL
from tests.support.dashboards import panel_queries, substitute

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "dashboards" / "kvobs-offload.json"
RECORDING = ROOT / "dashboards" / "rules" / "kvobs-recording.yaml"
RULE = "engine_cause:kvobs_load_failures:increase1h"
SCRAPE_S = 15
FAILED_AT_S = 22 * 60 + 45  # the first scrape that shows the failure
SAMPLES = 80 * 60 // SCRAPE_S
SIDECAR = {"job": "kvobs", "namespace": "llm", "instance": "vllm-abc", "model_name": "m", "engine": "0"}
VLLM = {"job": "vllm", "namespace": "llm", "instance": "10.0.0.5:8000", "model_name": "m", "engine": "0"}
POD = {k: SIDECAR[k] for k in ("job", "namespace", "instance")}  # the sidecar's own series


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
    both paths; one offload exception (sidecar only); steady evictions and near misses (1 a second) on both
    paths; the sidecar's build info, its polls and the engine's start (at 0, before the first scrape)."""
    inputs = [series("kvobs_build_info", {**SIDECAR, "version": "0.1.0", "vllm_version": "0.33.0",
                                          "hot_path": "compiled"}, f"1x{SAMPLES - 1}"),
              series(ENGINE_START, SIDECAR, f"0x{SAMPLES - 1}"),
              series(SIDECAR_POLL, POD, f"0+{SCRAPE_S}x{SAMPLES - 1}")]
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
    # An exception that left vLLM's offloading code at the same scrape (sidecar only), and the counter's
    # pre-initialised series of the other cause (site "").
    inputs.append(series("kvobs_offload_exceptions_total",
                         {**SIDECAR, "cause": "vllm_assertion", "site": "v1/kv_offload/cpu/manager.py:prepare_store"},
                         step_at(1)))
    inputs.append(series("kvobs_offload_exceptions_total", {**SIDECAR, "cause": "vllm_exception", "site": ""},
                         f"0x{SAMPLES - 1}"))
    for le, hit in (("0.1", 0), ("0.5", 1), ("+Inf", 1)):
        inputs.append(series("kvobs_missing_chunk_eviction_age_seconds_bucket", {**SIDECAR, "group": "0", "le": le},
                             step_at(hit)))
    for le, hit in (("1", 0), ("5", 1), ("+Inf", 1)):
        inputs.append(series("kvobs_chunk_residency_seconds_bucket", {**SIDECAR, "reason": "capacity", "le": le},
                             step_at(hit)))
    return inputs


def grafana(expr: str, step: str, span: str = "1h") -> str:
    """``expr`` as Grafana sends it: every dashboard variable at "All" (job: "kvobs"), ``$__interval``
    ``step``, ``$__range`` ``span``."""
    variables = {v["name"]: ".*" for v in json.loads(DASHBOARD.read_text())["templating"]["list"]}
    return substitute(expr, {**variables, "job": "kvobs", "datasource": "prometheus", "__rate_interval": "1m",
                             "__interval": step, "__interval_ms": str(seconds(step) * 1000),
                             "__range": span, "__range_s": str(seconds(span))})


def seconds(duration: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([smhd])", duration).groups()  # type: ignore[union-attr]
    return int(number) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[unit]


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
        filtered = re.search(r">\s*0\s*\)?\s*$", expr) is not None  # drawn only when it counted
        samples = [] if (filtered and value == 0) else [{"labels": "{}", "value": value}]
        cases.append({"expr": total(grafana(expr, f"{step_s}s")), "eval_time": f"{at}s", "exp_samples": samples})
    return cases


def counting_queries() -> list[tuple[str, str]]:
    """The count queries of the shipped dashboard (one metric: ratios of two counts are left out)."""
    dashboard = json.loads(DASHBOARD.read_text())
    ratio = re.compile(r"\)\s*/\s*\(")
    return [(where, e) for where, e in panel_queries(dashboard) if ENGINE_START in e and not ratio.search(e)]


def failure_counts() -> list[str]:
    """The failure count queries: the annotation, the per-step bars and the stat in range."""
    return [expr for _, expr in counting_queries() if "kvobs_load_failures_total" in expr]


def promtool_test(tmp_path: Path, tests: list[dict[str, Any]]) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: `make prometheus` installs Debian's prometheus (which ships it)"
    spec = {"rule_files": [str(RECORDING)], "evaluation_interval": "1m", "tests": tests}
    path = tmp_path / "counts-test.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    result = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "SUCCESS" in result.stdout, (result.stdout + result.stderr)[-6000:]


def test_every_count_panel_uses_a_form_that_survives_restarts() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [expr for _, expr in panel_queries(dashboard)]
    # increase() sees only differences between samples inside its window: a series' first value is lost.
    assert not any("increase(" in e for e in exprs)
    assert not any(re.search(r"(\w+\{[^{}]*\}) - \1 offset", e) for e in exprs), "x - x offset: blind to new series"
    where = {re.search(r"'(.*)'", w)[1] for w, _ in counting_queries()}  # type: ignore[index]
    assert {"Load failures in range", "Load failures by cause", "Missing chunks by group",
            "Chunk residency (capacity evictions)", "Eviction age at failure (in range)", "Load failures"} <= where


@pytest.mark.tools
def test_one_failure_is_counted_once_in_every_counting_query(tmp_path: Path) -> None:
    tests: list[dict[str, Any]] = []
    counted = 0
    for _, expr in counting_queries():
        if "$__range" in expr:  # an instant query over the dashboard's range: 1 at its end
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
    promtool_test(tmp_path, [{"interval": f"{SCRAPE_S}s", "input_series": one_failure(), "promql_expr_test": tests}])


def engine(counter: str, start_s: int, poll: str) -> list[dict[str, str]]:
    """One engine's failure counter (promtool values, a sample a minute), its start and its sidecar's polls."""
    return [series("kvobs_load_failures_total", {**SIDECAR, "cause": "evicted_after_lookup"}, counter),
            series(ENGINE_START, SIDECAR, _like(counter, start_s)),
            series(SIDECAR_POLL, POD, poll)]


def _like(values: str, constant: int) -> str:
    """``constant`` wherever ``values`` has a sample ("_": none), as promtool expands it."""
    out = []
    for part in values.split():
        if part.startswith("_"):
            out.append(part)
        else:
            repeat = re.fullmatch(r"[^x]+x(\d+)", part)
            out.append(f"{constant}x{repeat[1]}" if repeat else str(constant))
    return " ".join(out)


def instant(eval_time: str, span: str, value: int | None) -> list[dict[str, Any]]:
    """Every failure count over ``span`` at ``eval_time`` (the stat; the bars' steps of ``span`` too);
    None: no data (no sample of the engine in the span)."""
    cases = []
    for expr in failure_counts():
        hidden = value is None or (value == 0 and re.search(r">\s*0\s*\)?\s*$", expr))
        samples = [] if hidden else [{"labels": "{}", "value": value}]
        query = grafana(expr, "1m", span) if "$__range" in expr else grafana(expr, span)  # a step as long
        cases.append({"expr": total(query), "eval_time": eval_time, "exp_samples": samples})
    return cases


@pytest.mark.tools
def test_idle_engines_late_first_samples_and_first_scrape_failures_are_counted_right(tmp_path: Path) -> None:
    day = 24 * 60  # samples a day, one a minute
    # An engine idle for six days: started at 10 min, two failures at 30 min, one at 6 d 12 h 30 min.
    idle_failure = 6 * day + 12 * 60 + 30
    idle = engine(f"_x10 0x19 2x{idle_failure - 31} 3x{8 * 60}", 600, f"0+60x{idle_failure + 8 * 60}")
    idle_at = f"{idle_failure + 30}m"
    # A counter already at 5 at the first sample Prometheus has (at 40 min; the engine started at 10 min),
    # one more failure at 50 min.
    late = engine("_x40 5x9 6x20", 600, "_x40 2400+60x29")
    # An engine born at 20 min 30 s with a failure before its sidecar's first scrape of it (at 21 min),
    # the sidecar scraped since 0; another failure at 30 min.
    born = engine("_x21 1x8 2x20", 1230, "0+60x50")
    old_form = 'sum(kvobs_load_failures_total - kvobs_load_failures_total offset 30m)'
    tests = [
        {"interval": "1m", "input_series": idle, "promql_expr_test": [
            *instant(idle_at, "1h", 1), *instant(idle_at, "1d", 1),
            *instant(idle_at, "7d", 3),  # the range holds the engine's start: every failure since
            {"expr": f"sum({RULE})", "eval_time": idle_at, "exp_samples": [{"labels": "{}", "value": 1}]},
            {"expr": f"sum({RULE})", "eval_time": "6d", "exp_samples": [{"labels": "{}", "value": 0}]}]},
        {"interval": "1m", "input_series": late, "promql_expr_test": [
            *instant("60m", "1h", 6),  # from before the engine's start: the 5 are in the range
            *instant("60m", "30m", 1),  # the engine is older than the range: the 5 are not re-counted
            {"expr": f"sum({RULE})", "eval_time": "60m", "exp_samples": [{"labels": "{}", "value": 6}]}]},
        {"interval": "1m", "input_series": born, "promql_expr_test": [
            *instant("21m", "1m", 1),  # the step that holds its first scrape counts its failure
            *instant("20m", "1m", None), *instant("22m", "1m", 0), *instant("30m", "1m", 1),
            *instant("40m", "30m", 2), *instant("40m", "15m", 1),
            {"expr": f"sum({RULE})", "eval_time": "40m", "exp_samples": [{"labels": "{}", "value": 2}]},
            # Today's form before this: blind to a series born inside its window.
            {"expr": old_form, "eval_time": "40m", "exp_samples": []}]},
    ]
    promtool_test(tmp_path, tests)
