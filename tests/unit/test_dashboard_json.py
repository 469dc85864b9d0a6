"""Dashboards and rules are portable and complete: checked on the files as shipped (no Grafana needed).

They are generated (python -m dashboards.generate; tests/unit/test_dashboards_generated.py checks they
match the code): these tests check what the generated files say, whatever code wrote them."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dashboards import promql
from dashboards.config import load as load_config

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "dashboards").glob("*.json"))
RULES = ROOT / "dashboards" / "rules"
DS = {"type": "prometheus", "uid": "${datasource}"}
GRAFANA_BUILTIN = {"type": "grafana", "uid": "-- Grafana --"}  # the built-in annotation source, no real uid
VARIABLES = ("datasource", "cluster", "namespace", "job", "model_name", "instance", "engine")
# The selectors each kind of series must carry (tests below): kvobs's per-engine series (and the recorded
# ones) every variable; the sidecar's own series (kvobs_sidecar_*, up) no model_name or engine, since the
# sidecar carries neither (kvobs/sidecar/metrics.py); vLLM's series no $job (vLLM has its own scrape job).
ENGINE_MATCHERS = ('cluster=~"$cluster"', 'namespace=~"$namespace"', 'job="$job"', 'model_name=~"$model_name"',
                   'instance=~"$instance"', 'engine=~"$engine"')
SIDECAR_MATCHERS = ('cluster=~"$cluster"', 'namespace=~"$namespace"', 'job="$job"', 'instance=~"$instance"')
VLLM_MATCHERS = ('cluster=~"$cluster"', 'namespace=~"$namespace"', 'model_name=~"$model_name"',
                 'instance=~"$instance"', 'engine=~"$engine"')
HELPERS = {name for name in (getattr(promql, "ENGINE_START", None), getattr(promql, "SIDECAR_POLL", None)) if name}
"""Series the count forms of dashboards/promql.py read to tell a new engine from an old one: joined on the
engine (or sidecar) to the series the panel selects, so they need no selector of their own."""
ENGINES = "kvobs_build_info|vllm[:_]kv_offload_kvobs_evicted_chunks_total"
"""The series the per-engine variables read: the sidecar's build info, or kvobs's evictions on vLLM's
/metrics (the kvobs option vllm_metrics, kvobs/vllm/vllm_metrics.py)."""
BOTH_PATHS = {"evicted_chunks_total", "load_failures_total", "hits_evicted_before_load_total"}
"""kvobs's counters on either metrics path: the sidecar's kvobs_<name>, vLLM's vllm:kv_offload_kvobs_<name>."""
ENGINE_ID = "cluster, namespace, instance, model_name, engine"
"""How a two-path read groups each path's series (instance kept: the panels show it)."""
DEDUP_ON = "cluster, namespace, model_name, engine"
"""What one engine's series of both paths share whatever the scrape set-up: not instance, which differs
between the sidecar's target and vLLM's unless relabelled (issue 20). vLLM's read gives way, ``unless on``
these, to the sidecar's kvobs_build_info of the engine."""
IDENTITY = ("cluster", "namespace", "job", "instance", "model_name", "engine")
"""The labels every aggregation of the rules keeps (cluster/namespace: a global view never merges clusters)."""
SIDECAR_IDENTITY = ("cluster", "namespace", "job", "instance")
"""What a match against the sidecar's own series keeps: they carry no model_name or engine."""
SELF_WATCH = ("KvobsNotObserving", "KvobsSidecarReadsNoEngine", "KvobsSidecarCannotRead", "KvobsSidecarInternalErrors",
              "KvobsVersionSkew")
"""Issue 20: the alerts that say kvobs went blind, so that the others' silence means nothing happened."""


def load(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def walk(node: Any, path: str = "") -> Iterator[tuple[str, str, Any]]:
    """Every (path, key, value) pair of a JSON document."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield path, k, v
            yield from walk(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from walk(v, f"{path}[{i}]")


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def targets(dashboard: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(panel, target) for every panel target."""
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield panel, target


def exprs(dashboard: dict[str, Any]) -> Iterator[str]:
    """Every PromQL expression: panel targets and annotations."""
    for _, target in targets(dashboard):
        yield target["expr"]
    for annotation in dashboard["annotations"]["list"]:
        if "expr" in annotation:
            yield annotation["expr"]


def call_args(expr: str, func: str) -> Iterator[list[str]]:
    """The top-level arguments of every call of ``func`` in ``expr``."""
    for match in re.finditer(rf"\b{func}\s*\(", expr):
        depth, start, args = 1, match.end(), []
        i = start
        while depth:
            c = expr[i]
            if c in "([{":
                depth += 1
            elif c in ")]}":
                depth -= 1
            if (c == "," and depth == 1) or depth == 0:
                args.append(expr[start:i].strip())
                start = i + 1
            i += 1
        yield args


VLLM_SELECTOR = re.compile(r'\{__name__=~"vllm\[:_\](\w+)",\s*([^}]*)\}')
"""vLLM's series by either spelling: ``vllm:name``, or ``vllm_name`` as Prometheus 2.x stores it when
prometheus_client >= 0.26 answers its OpenMetrics scrape (client_python#1177 escapes the colon)."""


def without_vllm_name_regex(expr: str) -> str:
    """The expression with vLLM selectors written plainly (``vllm:name{...}``), for parsing."""
    return VLLM_SELECTOR.sub(lambda m: f"vllm:{m.group(1)}{{{m.group(2)}}}", expr)


def selectors(expr: str) -> Iterator[tuple[str, str | None]]:
    """(metric name, label matchers or None) for every kvobs/vLLM/up/recorded series an expression reads."""
    expr = without_vllm_name_regex(expr)
    for match in re.finditer(r"\b((?:[a-z_]+:)?kvobs_\w+(?::\w+)?|vllm:\w+|up)(\s*\{([^}]*)\})?", expr):
        if expr[match.end():].lstrip().startswith("(") and match.group(2) is None:
            continue  # a function of that name, not a series
        yield match.group(1), match.group(3)


def recorded_names() -> set[str]:
    doc = yaml.safe_load((RULES / "kvobs-recording.yaml").read_text())
    return {rule["record"] for group in doc["groups"] for rule in group["rules"]}


def alerts() -> list[dict[str, Any]]:
    doc = yaml.safe_load((RULES / "kvobs-alerts.yaml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"] if "alert" in rule]


def test_there_is_a_dashboard_and_provisioning() -> None:
    assert [p.name for p in DASHBOARDS] == ["kvobs-offload.json"]
    provisioning = ROOT / "dashboards" / "provisioning"
    sources = [yaml.safe_load(p.read_text()) for p in (provisioning / "datasources").glob("*.yaml")]
    assert any(ds["type"] == "prometheus" for doc in sources for ds in doc["datasources"])
    providers = [yaml.safe_load(p.read_text()) for p in (provisioning / "dashboards").glob("*.yaml")]
    assert any(p["type"] == "file" and p["options"]["path"] for doc in providers for p in doc["providers"])


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_datasource_is_the_variable_everywhere_and_no_uid_is_hard_coded(path: Path) -> None:
    dashboard = load(path)
    assert "__inputs" not in dashboard and "__requires" not in dashboard  # not an "export for sharing" file
    seen = 0
    for where, key, value in walk(dashboard):
        if key == "datasource":
            seen += 1
            if where.startswith(".templating") and isinstance(value, str):
                continue
            assert value == DS or (value == GRAFANA_BUILTIN and where.startswith(".annotations")), (where, value)
        if key == "uid" and where != "":  # the dashboard's own uid is its stable URL, not a data source
            assert value in (DS["uid"], GRAFANA_BUILTIN["uid"]), (where, value)
    assert seen > 20
    for panel in panels(dashboard):
        if panel["type"] not in ("row", "text"):
            assert panel["datasource"] == DS and panel["targets"], panel["title"]
            assert all(t["datasource"] == DS for t in panel["targets"]), panel["title"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_variables_datasource_cluster_job_model_name_instance_engine(path: Path) -> None:
    variables = load(path)["templating"]["list"]
    assert [v["name"] for v in variables] == list(VARIABLES)
    source = variables[0]
    assert source["type"] == "datasource" and source["query"] == "prometheus"
    defined = {"datasource"}
    for var in variables[1:]:
        query = var["query"]
        assert var["type"] == "query" and var["datasource"] == DS
        if var["name"] == "job":  # the sidecars' job: only the sidecar's kvobs_build_info has it
            match = re.fullmatch(r"label_values\(kvobs_build_info(\{.*\})?, (\w+)\)", query)
            follows = defined - {"datasource"}
        else:
            # The engines either metrics path shows (kvobs_build_info from the sidecar, kvobs's counter on
            # vLLM's /metrics with the option vllm_metrics): no sidecar pseudo-engine, no model without kvobs.
            # Not $job: with vLLM's path alone there is no sidecar job, and vLLM's series have their own.
            match = re.fullmatch(r"label_values\(\{__name__=~\"" + re.escape(ENGINES) + r"\"(, .*)?\}, (\w+)\)", query)
            follows = defined - {"datasource", "job"}
        assert match is not None and match.group(2) == var["name"], query
        assert set(re.findall(r"\$(\w+)", query)) == follows, f"{var['name']} does not follow: {query}"
        if var["name"] == "job":  # one sidecar job at a time: the selectors read job="$job"
            assert not var["includeAll"] and not var["multi"]
        elif var["name"] == "cluster":  # All matches series without the label too (a single Prometheus)
            assert var["includeAll"] and not var["multi"] and var["allValue"] == ".*"
        else:
            assert var["includeAll"] and var["multi"] and var["allValue"] == ".*"
        defined.add(var["name"])
    assert "model" not in defined


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_rate_uses_rate_interval_and_every_quantile_sums_by_le(path: Path) -> None:
    """Rates are over $__rate_interval. Counts are dashboards/promql.py's forms (their windows are the step,
    $__interval, or in an instant query the range, $__range, and their lookback before it); no hand-made
    ``increase()``, which extrapolates and misses a series' first scrape."""
    dashboard = load(path)
    all_exprs = list(exprs(dashboard))
    assert len(all_exprs) > 30
    instant = {t["expr"] for _, t in targets(dashboard) if t.get("instant") and not t.get("range")}
    quantiles = 0
    for raw in all_exprs:
        expr = without_vllm_name_regex(raw)
        step = "$__range" if raw in instant else "$__interval"
        windows = ("$__rate_interval", step, promql.LOOKBACK)
        for window in re.findall(r"\[([^\]]*)\]", expr):
            assert window in windows, expr
        for offset in re.findall(r"\boffset (\S+?)[,)\]]", expr):
            assert offset == step, expr
        assert "increase(" not in expr, expr
        for func in ("rate", "irate", "delta", "deriv", "changes"):
            for args in call_args(expr, func):
                assert args[0].endswith("[$__rate_interval]"), expr
        for args in call_args(expr, "histogram_quantile"):
            quantiles += 1
            by = re.match(r"sum by \(([^)]*)\) \(", args[1])
            assert by is not None and "le" in [label.strip() for label in by.group(1).split(",")], expr
            assert "_bucket{" in args[1], expr
    assert quantiles >= 6


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_series_follows_the_variables(path: Path) -> None:
    """kvobs's per-engine series follow every variable, the sidecar's own its job and instance, vLLM's
    the same model_name and engine (vLLM's own labels, which kvobs's series now carry too)."""
    recorded = recorded_names()
    kinds = set()
    for expr in exprs(load(path)):
        # vLLM's series are read under both spellings (see VLLM_SELECTOR), never as plain vllm:name.
        assert "vllm:" not in VLLM_SELECTOR.sub("", expr), expr
        assert not re.search(r"\bmodel\s*[=!]", expr), f"the obsolete model label in {expr}"
        found = list(selectors(expr))
        assert found, expr
        for name, matchers in found:
            if name in HELPERS and matchers is None:
                continue
            assert matchers is not None, f"{name} without a label selector in {expr}"
            given = [m.strip() for m in matchers.split(",")]
            if name.startswith("vllm:"):
                kind, wanted = "vllm", VLLM_MATCHERS
                assert not any(m.startswith("job") for m in given), expr  # vLLM's job is not the sidecar's
            elif name == "up" or name.startswith("kvobs_sidecar_"):
                kind, wanted = "sidecar", SIDECAR_MATCHERS
                assert not any(m.startswith(("model_name", "engine")) for m in given), expr  # it has neither
            else:
                kind, wanted = "engine", ENGINE_MATCHERS
            kinds.add(kind)
            assert given[:len(wanted)] == list(wanted) or set(wanted) <= set(given), (wanted, expr)
            if ":" in name and not name.startswith("vllm:"):
                assert name in recorded, f"{name} is not a recording rule of kvobs-recording.yaml"
    assert kinds == {"vllm", "sidecar", "engine"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_the_panels_operators_need_are_there(path: Path) -> None:
    dashboard = load(path)
    text = without_vllm_name_regex("\n".join(exprs(dashboard)))
    for metric in (
        "kvobs_evicted_chunks_total", "kvobs_eviction_batches_total", "kvobs_chunk_residency_seconds_bucket",
        "kvobs_history_window_seconds", "kvobs_history_chunks", "kvobs_load_failures_total",
        "kvobs_missing_chunks_total", "kvobs_hits_evicted_before_load_total",
        "kvobs_missing_chunk_eviction_age_seconds_bucket", "kvobs_sidecar_records_total",
        "kvobs_sidecar_last_poll_timestamp_seconds", "kvobs_engine_last_record_timestamp_seconds",
        "kvobs_dropped_records_total", "kvobs_internal_errors_total", "kvobs_offload_exceptions_total",
        "kvobs_build_info",
        "vllm:kv_offload_cpu_cache_usage_perc", "vllm:kv_offload_store_bytes_total",
    ):
        assert metric in text, metric
    assert {"sum by (reason)", "sum by (cause)", "sum by (group, cause)"} <= {
        m for m in re.findall(r"sum by \([^)]*\)", text)
    }
    kinds = [p["type"] for p in panels(dashboard)]
    assert "heatmap" in kinds and "stat" in kinds and kinds.count("timeseries") >= 15
    # The sidecar puts an exemplar {trace_id} on kvobs_load_failures_total (kvobs/sidecar/metrics.py).
    failures = [t for _, t in targets(dashboard) if "kvobs_load_failures_total{" in t["expr"] and t.get("exemplar")]
    assert failures, "no panel shows the load failures' exemplars"
    heatmap = next(p for p in panels(dashboard) if p["type"] == "heatmap")
    assert heatmap["targets"][0]["format"] == "heatmap"
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    assert all(p.get("title") for p in panels(dashboard))
    # The top panels show data without the recording rules; any other panel reading one says so.
    overview, row = set(), None
    for panel in dashboard["panels"]:
        row = panel["title"] if panel["type"] == "row" else row
        if row == "Overview" and panel["type"] != "row":
            overview.add(panel["id"])
    assert len(overview) >= 6
    reading_rules = 0
    for panel in panels(dashboard):
        used = recorded_names() & {n for t in panel.get("targets", []) for n, _ in selectors(t["expr"])}
        if used:
            reading_rules += 1
            assert panel["id"] not in overview, f"top panel {panel['title']!r} needs the recording rules"
            assert "kvobs-recording.yaml" in panel["description"] and all(n in panel["description"] for n in used)
    assert reading_rules >= 1  # the recording rules are used, and the check above is not vacuous


def duration_s(text: str) -> int:
    """A Prometheus duration of one unit (5m, 1h, 30s) in seconds."""
    match = re.fullmatch(r"(\d+)([smhd])", text)
    assert match is not None, text
    return int(match[1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[match[2]]


def test_alerts_follow_the_mixin_conventions() -> None:
    rules = alerts()
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names))
    for required in ("KvobsLoadFailure", "KvobsLoadFailuresRepeated", "KvobsOffloadException", "KvobsNearMissesRising",
                     "KvobsHistoryWindowTooShort", "KvobsSidecarDown", "KvobsSidecarAbsent", "KvobsRecordsDropped",
                     *SELF_WATCH):
        assert required in names
    runbook = (ROOT / "docs" / "runbook.md").read_text()
    headings = set(re.findall(r"^## (\w+)$", runbook, re.M))
    for rule in rules:
        name = rule["alert"]
        assert re.fullmatch(r"Kvobs(?:[A-Z][a-z]+)+", name), name
        assert rule["labels"]["severity"] in ("critical", "warning", "info")
        assert set(rule["annotations"]) >= {"summary", "description", "runbook_url"}
        assert name in headings, f"docs/runbook.md has no section for {name}"
        assert "$labels.model " not in str(rule["annotations"]) and "$labels.model}" not in str(rule["annotations"])
    severity = {rule["alert"]: rule["labels"]["severity"] for rule in rules}
    # One failure warns, a repeat pages (issue 20): the engine restarts after one, a second means it keeps dying.
    assert severity["KvobsLoadFailure"] == "warning" and severity["KvobsLoadFailuresRepeated"] == "critical"
    assert severity["KvobsNearMissesRising"] == severity["KvobsHistoryWindowTooShort"] == "warning"
    assert headings == set(names), "runbook sections without an alert"


def test_runbook_urls_are_absolute_from_one_configured_base() -> None:
    """Every URL is dashboards/config.yaml's runbook_base plus GitHub's anchor of the "## <name>" heading."""
    base = load_config().runbook_base
    assert re.fullmatch(r"https://[^\s#]+/docs/runbook\.md", base), base
    for rule in alerts():
        assert rule["annotations"]["runbook_url"] == f"{base}#{rule['alert'].lower()}", rule["alert"]


def test_alerts_keep_clusters_apart_and_warnings_wait() -> None:
    """Every by/on of the rules keeps cluster, namespace and the engine's identity; a warning whose
    expression a single event satisfies for a window waits longer than that window before firing."""
    doc = yaml.safe_load((RULES / "kvobs-recording.yaml").read_text())
    expressions = [rule["expr"] for group in doc["groups"] for rule in group["rules"]]
    expressions += [rule["expr"] for rule in alerts()]
    groupings = 0
    for expr in expressions:
        for clause in re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", expr):
            labels = {label.strip() for label in clause.split(",")}
            # A match against the sidecar's own series (no engine labels) keeps the scrape's identity.
            wanted = SIDECAR_IDENTITY if "kvobs_sidecar_" in expr else IDENTITY
            assert set(wanted) <= labels, (clause, expr)
            groupings += 1
        if not re.search(r"\b(?:by|on)\s*\(", expr):  # no aggregation: a sidecar's own series, as scraped
            assert {name for name, _ in selectors(expr)} <= {"up"} | {
                n for n, _ in selectors(expr) if n.startswith("kvobs_sidecar_")}, expr
        assert not re.search(r"\b(?:without|ignoring)\s*\(", expr), expr
    assert groupings >= len(expressions) - 6  # the six alerts on the sidecar's own series alone
    for rule in alerts():
        if rule["labels"]["severity"] == "critical" or rule["alert"] in (
                "KvobsLoadFailure", "KvobsFailureReportLost", "KvobsOffloadException", "KvobsSidecarSkipping"):
            continue  # one failed load (with or without its report), one offload exception, one skipped line:
            # the event to warn about
        if rule["alert"] == "KvobsRecomputesKeepHappening":
            continue  # the engine's alarm is that event: it already waited for an hour's recomputes
        assert "for" in rule, f"{rule['alert']}: a warning without for"
        windows = [duration_s(w) for w in re.findall(r"\[(\w+)\]", rule["expr"])]
        if windows:
            assert duration_s(rule["for"]) > max(windows), rule["alert"]
    absent = [rule for rule in alerts() if rule["expr"].replace(" ", "") == 'absent(up{job="kvobs"}==1)']
    assert len(absent) == 1 and "for" in absent[0]


def test_every_alert_has_a_promtool_test_that_fires_and_one_that_does_not() -> None:
    fires: set[str] = set()
    quiet: set[str] = set()
    for path in (RULES / "tests").glob("*.yaml"):
        doc = yaml.safe_load(path.read_text())
        for group in doc["tests"]:
            for case in group.get("alert_rule_test", []):
                (fires if case.get("exp_alerts") else quiet).add(case["alertname"])
    names = {rule["alert"] for rule in alerts()}
    assert names - fires == set(), "alerts without a firing test"
    assert names - quiet == set(), "alerts without a not-firing test"
    assert (fires | quiet) <= names, "tests of alerts that do not exist"


def kvobs_counter_reads(expr: str) -> Iterator[tuple[str, str]]:
    """(metric, path) for every read of the three counters both paths carry: path "sidecar" or "vllm"."""
    for name, _ in selectors(expr):
        for counter in BOTH_PATHS:
            if name == f"kvobs_{counter}":
                yield counter, "sidecar"
            elif name == f"vllm:kv_offload_kvobs_{counter}":
                yield counter, "vllm"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_the_counters_of_both_paths_are_read_either_or_never_both(path: Path) -> None:
    """Issue 15: evictions, load failures and near misses from the sidecar or vLLM's /metrics. Each read
    of one of them is ``sum by (<engine>, <label>) (f(sidecar's)) or sum by (<engine>, <label>) (f(vLLM's))``:
    the same grouping on both sides, so ``or`` keeps the sidecar's engine where both are scraped."""
    dashboard = load(path)
    sidecar_only = {p["title"] for p in panels(dashboard)
                    if re.search(r"\bneeds? the sidecar\b", p.get("description", ""), re.I)
                    and not re.search(r"either metrics path", p.get("description", ""), re.I)}
    dedup = re.compile(r"unless on \((?P<on>[^)]*)\) kvobs_build_info\{(?P<u>[^}]*)\}")
    dual_panels = set()
    for where, expr in [*((p["title"], t["expr"]) for p, t in targets(dashboard)),
                        *(("annotation", a["expr"]) for a in dashboard["annotations"]["list"] if "expr" in a)]:
        reads = list(kvobs_counter_reads(expr))
        if not reads:
            continue
        if {path for _, path in reads} == {"sidecar"} and where in sidecar_only:
            continue  # e.g. a ratio to a counter only the sidecar has (write waste): the sidecar's alone
        # Each counter is read from both paths (the count forms read each path's series several times).
        for counter in {c for c, _ in reads}:
            assert {path for c, path in reads if c == counter} == {"sidecar", "vllm"}, (where, counter, expr)
        matches = list(dedup.finditer(expr))
        assert matches, f"{where}: vLLM's read never gives way to the sidecar's: {expr}"
        for match in matches:
            assert match["on"] == DEDUP_ON, expr  # never instance: it differs between the two scrapes
            assert match["u"] == ", ".join(ENGINE_MATCHERS), expr
        for by in re.findall(r"sum by \(([^)]*)\) \((?:rate|clamp_min|\(\()", expr):
            assert by.startswith(ENGINE_ID), (by, expr)  # both sides grouped alike: "or" keeps the sidecar's
        if where != "annotation":
            dual_panels.add(where)
    assert dual_panels >= {"Load failures in range", "Near misses /s", "Load failures by cause",
                           "Near misses by reason", "Eviction rate by reason", "Near misses and failures per engine"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_panels_only_the_sidecar_feeds_say_so(path: Path) -> None:
    """A panel reading a kvobs series vLLM's /metrics does not carry says it needs the sidecar; the
    dashboard says which panels work from either path."""
    dashboard = load(path)
    sidecar_only = 0
    for panel in panels(dashboard):
        # kvobs_build_info after "unless on" only tells vLLM's read to give way to the sidecar's.
        names = {name for t in panel.get("targets", [])
                 for name, _ in selectors(re.sub(r"unless on \([^)]*\) kvobs_build_info\{[^}]*\}", "", t["expr"]))}
        only = {n for n in names if not n.startswith("vllm:")} - {f"kvobs_{c}" for c in BOTH_PATHS} - HELPERS
        if only:
            sidecar_only += 1
            assert re.search(r"\bneeds? the sidecar\b", panel["description"], re.I), (panel["title"], only)
        elif names and all(n.startswith("vllm:") for n in names):
            assert "needs the sidecar" not in panel["description"].lower(), panel["title"]
    assert sidecar_only >= 15
    (note,) = [p for p in panels(dashboard) if p["type"] == "text"]
    assert "vllm_metrics" in note["options"]["content"] and "sidecar" in note["options"]["content"]
    assert "vllm_metrics" in dashboard["description"]


def test_load_failure_alerts_read_when_failures_happened() -> None:
    """Issue 20: the load-failure alerts read the sidecar's failure-time gauges, never when this Prometheus
    first saw a counter (increase, offset, unless): those re-raise old failures after a restart, on a
    new HA replica or after a scrape gap (the promtool tests show each case)."""
    by_name = {rule["alert"]: rule["expr"] for rule in alerts()}
    assert "kvobs_last_load_failure_timestamp_seconds" in by_name["KvobsLoadFailure"]
    assert "kvobs_previous_load_failure_timestamp_seconds" in by_name["KvobsLoadFailuresRepeated"]
    for name in ("KvobsLoadFailure", "KvobsLoadFailuresRepeated"):
        assert not re.search(r"\b(?:increase|rate|offset|unless|absent)\b", by_name[name]), by_name[name]
    tests = (RULES / "tests" / "kvobs-alerts-test.yaml").read_text()
    for case in ("restarted at 4h", "HA replicas", "scrape gap"):
        assert case in tests, case


def test_kvobs_watches_itself() -> None:
    """Each way kvobs goes blind has an alert on the series that shows it."""
    by_name = {rule["alert"]: rule["expr"] for rule in alerts()}
    for name, metric in (("KvobsNotObserving", "kvobs_observing"),
                         ("KvobsSidecarReadsNoEngine", "kvobs_sidecar_engines"),
                         ("KvobsSidecarCannotRead", "kvobs_sidecar_unreadable_files"),
                         ("KvobsSidecarInternalErrors", "kvobs_sidecar_internal_errors_total"),
                         ("KvobsVersionSkew", "kvobs_sidecar_build_info")):
        assert metric in by_name[name], name
    assert "kvobs_build_info" in by_name["KvobsVersionSkew"]
