"""kvobs's alerting rules (dashboards/rules/kvobs-alerts.yaml), as data: names, expressions, texts.

Conventions of the monitoring mixins: Kvobs* names, a severity label, summary / description /
runbook_url annotations (the runbook URL from dashboards/config.yaml's base plus the alert's anchor in
docs/runbook.md). Every aggregation keeps the engine's identity (:attr:`Config.identity`), so two
clusters' engines never merge and the Alertmanager inhibit rule can match on cluster, namespace,
instance, model_name and engine.
"""

from __future__ import annotations

from typing import Any

from dashboards.config import Config
from dashboards.dashboard import HISTORY_WINDOW_ALERT_S
from dashboards.names import m, matcher, on_vllm
from kvobs.codes import read_back_share_promql

FAILURE_WINDOW_S = 3600
"""How long a failed load keeps its alerts firing (the failure-time gauges say when it happened)."""
KEEP_FIRING = "15m"
"""keep_firing_for of the failure alerts: a sidecar restart or a scrape gap shorter than this (the series
vanish, then come back from the sidecar's checkpoint) neither resolves them nor pages a second time."""

COMMENT = f"""\
# kvobs alerting rules. runbook_url: dashboards/config.yaml's runbook_base plus "#<alert name in lower case>",
# the anchor of its section in docs/runbook.md (change the base there and regenerate).
#
# Labels: the sidecar exports model_name and engine on every per-engine series, with vLLM's own values
# (engine = vLLM's engine index, the data-parallel rank). Prometheus adds job (the sidecar's scrape job,
# dashboards/config.yaml's job: docker/prometheus/prometheus.yml and docker/k8s/ name it so), instance, and
# in Kubernetes namespace. Every aggregation keeps cluster and namespace too, so that a global view
# (Thanos, Mimir, where cluster is an external label) never merges two clusters' engines.
#
# One page per incident per engine: a failed load warns at once (KvobsLoadFailure, one alert an engine
# whatever its causes; the description lists them) and pages on a second failure of the engine within
# the hour (KvobsLoadFailuresRepeated, critical). Both read when the failure happened (the sidecar's
# failure-time gauges), not when this Prometheus saw a counter move, and keep firing for {KEEP_FIRING} through
# a sidecar restart or scrape gap (keep_firing_for), so neither resolves falsely nor pages twice.
#
# An exception that left vLLM's offloading code (an assertion or error other than the failed load kvobs
# explains) warns at once (KvobsOffloadException, one alert an engine, for an hour; the description lists
# its sites and causes): like one failed load it normally takes the EngineCore down once.
#
# Warnings that one event would raise wait with "for:" (each expression looks at a window and must hold
# for longer); the events worth a warning at once (a failure, a lost report, an offload exception, skipped
# journal lines) fire at once. kvobs watches itself: KvobsNotObserving, KvobsUnavailable,
# KvobsSidecarReadsNoEngine, KvobsSidecarCannotRead, KvobsSidecarSkipping, KvobsSidecarInternalErrors and
# KvobsVersionSkew say when kvobs went blind, so that the other alerts' silence means "nothing happened",
# not "nothing was seen".
"""


def _causes(config: Config, metric: str) -> str:
    """A template listing, sorted, the causes of the engine's failures within the hour (``query`` runs at
    the alert's evaluation), so the text names every cause the one alert covers."""
    matchers = ",".join(f"{label}=%q" for label in config.identity)
    args = " ".join(f"$labels.{label}" for label in config.identity)
    query = f'printf "({metric}{{{matchers}}} > 0) > time() - {FAILURE_WINDOW_S}" {args}'
    return (f"{{{{ range $i, $s := query ({query}) | sortByLabel \"cause\" }}}}{{{{ if $i }}}}, {{{{ end }}}}"
            "{{ $s.Labels.cause }}{{ end }}")


def _sites(config: Config, metric: str, since: str) -> str:
    """A template listing, sorted, ``site (cause)`` of each of the engine's series of the counter ``metric``
    (labels site and cause) that moved within the hour, counted as the alert counts them
    (:meth:`Counts.counted` from ``since``). The engine's matchers index printf's arguments (``%[1]q``):
    the count reads the series several times."""
    matchers = ",".join(f"{label}=%[{i}]q" for i, label in enumerate(config.identity, 1))
    args = " ".join(f"$labels.{label}" for label in config.identity)
    moved = config.counts.counted(metric, matchers, "1h", since)
    query = f'printf "sum by (site, cause) ({moved}) > 0" {args}'
    return (f"{{{{ range $i, $s := query ({query}) | sortByLabel \"site\" }}}}{{{{ if $i }}}}, {{{{ end }}}}"
            "{{ $s.Labels.site }} ({{ $s.Labels.cause }}){{ end }}")


def rules(config: Config) -> dict[str, Any]:
    """The rule file's document."""
    engine = ", ".join(config.identity)
    sidecar = ", ".join(config.sidecar_identity)
    up = f'up{{job="{config.job}"}}'
    at = "engine {{ $labels.engine }} of {{ $labels.model_name }} at {{ $labels.instance }}"
    at_cap = "Engine {{ $labels.engine }} of {{ $labels.model_name }} at {{ $labels.instance }}"
    window = FAILURE_WINDOW_S
    last_failure, previous_failure = (m("kvobs_last_load_failure_timestamp_seconds"),
                                      m("kvobs_previous_load_failure_timestamp_seconds"))
    failures, errors = m("kvobs_load_failures", "total"), m("kvobs_internal_errors", "total")
    report = matcher("kvobs_internal_errors", "stage", "report")
    build, sidecar_build = m("kvobs_build_info"), m("kvobs_sidecar_build_info")
    causes = _causes(config, last_failure)
    counts = config.counts  # one event must alert even in a series' first scrape (dashboards/promql.py)
    hour_ago = f"(time() - {FAILURE_WINDOW_S})"
    report_errors = counts.counted(errors, report, "1h", hour_ago)
    recompute_alarms = counts.counted(m("kvobs_recompute_alarms", "total"), "", "1h", hour_ago)
    exceptions = m("kvobs_offload_exceptions", "total")
    offload_exceptions = counts.counted(exceptions, "", "1h", hour_ago)

    def alert(name: str, expr: str, severity: str, summary: str, description: str, *,
              for_: str | None = None, keep_firing_for: str | None = None) -> dict[str, Any]:
        rule: dict[str, Any] = {"alert": name, "expr": expr}
        if for_:
            rule["for"] = for_
        if keep_firing_for:
            rule["keep_firing_for"] = keep_firing_for
        rule["labels"] = {"severity": severity}
        rule["annotations"] = {"summary": summary, "description": description, "runbook_url": config.runbook(name)}
        return rule

    failed = "vLLM's prepare_load asserted a chunk was not there to load"
    return {"groups": [{"name": "kvobs.alerts", "rules": [
        # When the newest failure of any cause happened (the sidecar's failure-report time): a Prometheus
        # restarted without its storage, a second HA replica or a scrape gap neither re-raises old failures
        # nor misses one of the last hour. One alert an engine; the value: how long ago.
        alert("KvobsLoadFailure",
              f"time() - max by ({engine}) ({last_failure} > 0) < {window}\n",
              "warning",
              "A KV offload load failed on engine {{ $labels.engine }} of {{ $labels.model_name }}; kvobs named "
              "its cause.",
              f"On {at}, {failed} (\"not found in cache\", or \"not ready for reading\" for store_in_flight), "
              "{{ $value | humanizeDuration }} ago. Causes within the hour: " + causes + ". The assertion "
              "normally takes the EngineCore down. The failure report, with the missing keys and their last "
              "removal, is at the sidecar's /api/v1/failures. A second failure of this engine within the hour, "
              "of any cause, raises KvobsLoadFailuresRepeated (critical).",
              keep_firing_for=KEEP_FIRING),
        # Two failures of one engine in the hour, whatever their causes: the failure times within the hour
        # (each cause's newest and the one before it) counted per engine. One alert an engine.
        alert("KvobsLoadFailuresRepeated",
              f"count by ({engine}) (\n"
              f"  (time() - ({last_failure} > 0) < {window})\n"
              "  or\n"
              f"  label_replace(time() - ({previous_failure} > 0) < {window},"
              ' "failure", "previous", "", "")\n'
              ") > 1\n",
              "critical",
              "KV offload loads keep failing on engine {{ $labels.engine }} of {{ $labels.model_name }}.",
              f"{at_cap} has failed at least {{{{ $value }}}} times within the hour (causes: {causes}). Each "
              "failure normally takes the EngineCore down: it will fail again under this load.",
              keep_firing_for=KEEP_FIRING),
        # A failed load whose report could not be written (a full or read-only KVOBS_DIR): counted in
        # kvobs_load_failures_total but it moves no failure-time gauge (read from reports), so the two
        # alerts above never see it. kvobs writes reports at stage "report" only, and only for a failed load.
        alert("KvobsFailureReportLost",
              f"sum by ({engine}) ({report_errors}) > 0",
              "warning",
              "A kvobs failure report could not be written; the load-failure alerts cannot see that failure.",
              f"kvobs on {at} could not write a failure report in the last hour "
              f"({errors}{{{report}}}), nearly always a full or read-only KVOBS_DIR. The "
              f"failed load is counted in {failures}, but KvobsLoadFailure and "
              "KvobsLoadFailuresRepeated read the reports and do not fire for it, and /api/v1/failures does not "
              "have it. The engine's log has the assertion.",
              keep_firing_for=KEEP_FIRING),
        # An exception that left vLLM's offloading code through kvobs's connector (kvobs/vllm/boundary.py;
        # docs/vllm.md, "Other offload exceptions"), other than the failed load kvobs explains (that one is
        # kvobs_load_failures_total and the alerts above). Warning, not critical: like one failed load it
        # normally takes the EngineCore down once and the engine restarts; the convention (COMMENT) pages
        # on a repeat (KvobsLoadFailuresRepeated), not on one death. Counted as KvobsFailureReportLost
        # counts (dashboards/promql.py): an engine that died before its first scrape still warns.
        alert("KvobsOffloadException",
              f"sum by ({engine}) ({offload_exceptions}) > 0",
              "warning",
              "An exception left vLLM's KV offloading code on engine {{ $labels.engine }} of "
              "{{ $labels.model_name }}.",
              f"On {at}, {{{{ $value }}}} exceptions left vLLM's offloading code in the last hour ({exceptions}), "
              "at: " + _sites(config, exceptions, hour_ago) + ". Not the failed load kvobs explains "
              "(KvobsLoadFailure): an assertion or error of vLLM's own, which normally takes the EngineCore "
              "down. The failure report (site, expression, the requests involved) is at the sidecar's "
              "/api/v1/failures; kvobs explain reads the engine's log (its traceback or kvobs's \"kv offload "
              "exception at\" line).",
              keep_firing_for=KEEP_FIRING),
        alert("KvobsNearMissesRising",
              f"sum by ({engine}) (increase({m('kvobs_hits_evicted_before_load', 'total')}[10m])) > 10",
              "warning",
              "Offload hits are being evicted before their load (near misses).",
              f"{at_cap} saw {{{{ printf \"%.0f\" $value }}}} chunks in the last 10 minutes that a lookup reported "
              "and that were removed before the request's load pinned them. Each one is a load failure "
              "(evicted_after_lookup) waiting to happen.",
              for_="15m"),
        # The window grows with uptime until the history is full, so "for" keeps a fresh engine quiet.
        alert("KvobsHistoryWindowTooShort",
              f"min by ({engine}) ({m('kvobs_history_window_seconds')}) < {HISTORY_WINDOW_ALERT_S}\n"
              f"and on ({engine})\n"
              f"sum by ({engine}) (rate({m('kvobs_evicted_chunks', 'total')}[10m])) > 0\n",
              "warning",
              f"kvobs's eviction history covers less than {HISTORY_WINDOW_ALERT_S // 60} minutes.",
              f"The eviction history of {at} reaches back only {{{{ printf \"%.0f\" $value }}}}s. A failed load "
              "whose chunk was removed earlier than that gets the cause \"unknown\" instead of a named one. "
              "Raise the kvobs option history_size.",
              for_="15m"),
        # The vLLM path: a tier written to for an hour and never read back (vLLM #56871: "280 GB written in
        # one night, nothing loaded"): stores in every 10 minutes of the last hour, no load in any of them.
        # The read-back share (kvobs.codes.READ_BACK_SHARE) at 0: chunks written, none read even once.
        alert("KvobsTierWritesNeverRead",
              f"{read_back_share_promql(lambda name: f'increase({name}[10m])', f'{engine}, tier')} == 0\n",
              "warning",
              "The {{ $labels.tier }} offload tier of an engine is written to and never read back.",
              f"{at_cap} has written chunks into its {{{{ $labels.tier }}}} tier throughout the last hour and read "
              "none of them back (read-back share 0). The tier costs transfer bandwidth and memory and saves no "
              "prefill: requests do not share prefixes, the prefixes are evicted before reuse, or lookups do not "
              "reach the tier. See the dashboard's \"Is the tier doing anything\" row.",
              for_="1h"),
        alert("KvobsSidecarDown", f"{up} == 0", "warning",
              "The kvobs sidecar cannot be scraped.",
              "Prometheus has not scraped the kvobs sidecar at {{ $labels.instance }} for 5 minutes. Engines keep "
              "writing the journal and failure reports to KVOBS_DIR; the sidecar reads them when it is back, but "
              "until then no kvobs metrics or alerts reach you.",
              for_="5m"),
        # No target of the job is up: none was discovered (the PodMonitor's labels do not match the
        # Prometheus's selector, the pods lost the port name), the job was renamed, or every sidecar is
        # down. KvobsSidecarDown cannot see this: it needs an up series to be 0.
        alert("KvobsSidecarAbsent", f"absent({up} == 1)", "warning",
              "No kvobs sidecar is being scraped.",
              f"Prometheus has had no successfully scraped target of job \"{config.job}\" for 10 minutes. Without "
              "one, none of the kvobs alerts can fire.",
              for_="10m"),
        alert("KvobsSidecarIngestStalled", f"time() - {m('kvobs_sidecar_last_poll_timestamp_seconds')} > 120",
              "warning",
              "The kvobs sidecar answers but has stopped reading the engines' journals.",
              "The sidecar at {{ $labels.instance }} last read KVOBS_DIR {{ printf \"%.0f\" $value }}s ago. Its "
              "metrics are frozen.",
              for_="5m"),
        alert("KvobsRecordsDropped",
              f"sum by ({engine}, stage) (increase({m('kvobs_dropped_records', 'total')}[5m])) > 0", "warning",
              "kvobs keeps dropping records to stay bounded (stage {{ $labels.stage }}).",
              f"{at_cap} has dropped records at stage {{{{ $labels.stage }}}} in every 5 minutes of the last 15 "
              "({{ printf \"%.0f\" $value }} in the last 5). Counters stay exact; histograms and lookup verdicts "
              "may be incomplete, so a failure's cause can read coverage_mismatch or unknown where it was "
              "something else.",
              for_="15m"),
        alert("KvobsInternalErrors",
              f"sum by ({engine}, stage) (increase({errors}[5m])) > 0", "warning",
              "kvobs keeps catching faults of its own (stage {{ $labels.stage }}).",
              f"kvobs has caught faults of its own at stage {{{{ $labels.stage }}}} on {at} in every 5 minutes of "
              "the last 15 ({{ printf \"%.0f\" $value }} in the last 5). vLLM's behaviour is unchanged (kvobs "
              "never raises into vLLM), but its evidence may be incomplete.",
              for_="15m"),
        # The plugin stepped aside (a vLLM it does not know, or an error at start-up): vLLM runs unobserved.
        alert("KvobsNotObserving", f"max by ({engine}, reason) ({m('kvobs_observing')}) == 0", "warning",
              "kvobs stepped aside on an engine (reason {{ $labels.reason }}); its failures are not explained.",
              f"The kvobs plugin on {at} does not observe the offload manager (reason {{{{ $labels.reason }}}}): "
              "vLLM runs exactly as without kvobs, and no kvobs alert can fire for this engine. Usually a vLLM "
              "upgrade kvobs does not know yet.",
              for_="5m"),
        # A part of kvobs its options ask for does not work (an unusable directory: no journal, reports or
        # bundles; a flight recorder that cannot run). Only vLLM's own /metrics can say so (the vllm_metrics
        # option): the sidecar learns of an engine from the directory that is the problem.
        alert("KvobsUnavailable", f"max by ({engine}, part) ({on_vllm('kvobs_unavailable')}) == 1", "warning",
              "kvobs's {{ $labels.part }} does not work on engine {{ $labels.engine }} of {{ $labels.model_name }}.",
              f"On {at}, the kvobs part {{{{ $labels.part }}}} that its options ask for does not work. dir: the "
              "directory (option dir or KVOBS_DIR) is unusable, so kvobs writes no journal, no failure reports "
              "and no replay bundles and the sidecar sees nothing of this engine (the failure message in vLLM's "
              "log still names the cause). flight_recorder: asked for by flight_calls and not recording, so a "
              "failure has no replay bundle. The engine's start-up WARNING names the path and the error.",
              for_="5m"),
        # Every vLLM with the plugin journals at start (its build info): a sidecar up for 15 minutes with
        # no engine reads the wrong directory, or files of another uid (KvobsSidecarCannotRead).
        alert("KvobsSidecarReadsNoEngine", f"{m('kvobs_sidecar_engines')} == 0", "warning",
              "The kvobs sidecar reads no engine.",
              "The sidecar at {{ $labels.instance }} has read no engine's journal for 15 minutes. If vLLM runs "
              "next to it, kvobs sees none of its evictions or failures: check the uid (both containers must run "
              "as one uid), the shared directory (KVOBS_DIR on both sides) and the plugin in --kv-transfer-config.",
              for_="15m"),
        alert("KvobsSidecarCannotRead", f"{m('kvobs_sidecar_unreadable_files')} > 0", "warning",
              "The kvobs sidecar cannot read {{ $value }} of the engines' files or directories.",
              "The sidecar at {{ $labels.instance }} cannot read (or write its checkpoint in) {{ $value }} paths "
              "of the kvobs directory, nearly always files of another uid (kvobs writes 0600 files in 0700 "
              "directories). GET /healthz on the sidecar names them. What they hold is not counted or alerted on.",
              for_="5m"),
        # A corrupt journal line, an unreadable journal file or report, a damaged checkpoint: what it held
        # is not counted, and nothing else says so. One is worth a warning at once, for an hour.
        alert("KvobsSidecarSkipping",
              f"sum by ({sidecar}, source, reason) (increase({m('kvobs_sidecar_skipped', 'total')}[1h])) > 0",
              "warning",
              "The kvobs sidecar skipped {{ $labels.source }} input ({{ $labels.reason }}): kvobs is partly blind.",
              "The sidecar at {{ $labels.instance }} skipped {{ printf \"%.0f\" $value }} {{ $labels.source }} "
              "lines or files in the last hour ({{ $labels.reason }}). Their evictions, failures or counts are "
              "not in kvobs's metrics, and a failure among them raises no alert. Its log names each file."),
        alert("KvobsSidecarInternalErrors", f"increase({m('kvobs_sidecar_internal_errors', 'total')}[5m]) > 0",
              "warning",
              "The kvobs sidecar's ingest rounds keep failing.",
              "Ingest rounds of the sidecar at {{ $labels.instance }} failed in every 5 minutes of the last 15 "
              "({{ printf \"%.0f\" $value }} in the last 5). Its metrics may be incomplete; its log has the "
              "traceback.",
              for_="15m"),
        # Both series come from the same sidecar: the engine's kvobs (its journal) and the sidecar's own.
        alert("KvobsVersionSkew",
              f"count by ({engine}, version) ({build})\n"
              f"unless on ({sidecar}, version) {sidecar_build}\n",
              "warning",
              "The kvobs sidecar and the plugin of an engine run different kvobs versions.",
              f"{at_cap} writes with kvobs {{{{ $labels.version }}}}, and its sidecar reads with another version "
              f"({sidecar_build}). Every count the older side knows is read; one under a label value it "
              "does not know is exported only by a newer sidecar. Finish the rolling upgrade: one kvobs version "
              "in both images.",
              for_="15m"),
        # Survive mode: the engine raised its alarm, more recomputed loads within an hour than its
        # survive_alarm_per_hour option allows; the threshold is the option, read nowhere else.
        alert("KvobsRecomputesKeepHappening",
              f"sum by ({engine}) ({recompute_alarms}) > 0", "warning",
              "Survive mode keeps turning failed loads into recomputes on an engine.",
              f"{at_cap} recomputed more loads within an hour than its survive_alarm_per_hour option allows. The "
              "engine serves on, but every recompute is a lost cache hit: the offload tier keeps losing chunks "
              f"requests were promised (see the causes in {failures} and the failure reports)."),
    ]}]}
