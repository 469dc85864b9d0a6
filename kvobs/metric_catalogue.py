"""Every ``kvobs_*`` metric, once: name, type, labels, help (stdlib only; cheap to import).

Both exporters build their metrics from here: the sidecar's Prometheus collector
(``kvobs/sidecar/metrics.py``, every metric) and kvobs's opt-in counters on vLLM's own ``/metrics``
(``kvobs/vllm/vllm_metrics.py``, the three of :data:`ON_VLLM`, under ``vllm:kv_offload_`` + name).
Names are as prometheus_client's metric families take them: a counter's without its ``_total``
(exposed with it). The names and labels are a contract (DESIGN.md, README "Metrics", the dashboards):
add a metric here, never rename one.
"""

from __future__ import annotations

from typing import NamedTuple

ENGINE_LABELS = ("model_name", "engine")
"""vLLM's own identity labels, with vLLM's values: kvobs_* series join vllm:* series on them."""


class MetricDef(NamedTuple):
    name: str
    """As prometheus_client's families take it (a counter's without ``_total``)."""
    type: str
    """``counter``, ``gauge`` or ``histogram``."""
    labels: tuple[str, ...]
    """Besides :data:`ENGINE_LABELS`, which an engine's series carry first (``per_engine``)."""
    help: str
    per_engine: bool = True
    """False for the sidecar's own health series: no engine labels."""

    @property
    def label_names(self) -> tuple[str, ...]:
        """Every label of a series, in order."""
        return (*ENGINE_LABELS, *self.labels) if self.per_engine else self.labels


METRICS: tuple[MetricDef, ...] = (
    MetricDef("kvobs_evicted_chunks", "counter", ("reason",), "Chunks removed from the CPU tier, by reason."),
    MetricDef("kvobs_eviction_batches", "counter", ("reason",), "Removal batches from the CPU tier, by reason."),
    MetricDef("kvobs_load_failures", "counter", ("cause",), "Failed prepare_load calls, by cause."),
    MetricDef("kvobs_missing_chunks", "counter", ("cause", "group"),
              "Chunks missing at a failed load, by cause and KV group."),
    MetricDef("kvobs_missing_chunk_eviction_age_seconds", "histogram", ("group",),
              "Seconds between a missing chunk's last removal and the failed load."),
    MetricDef("kvobs_chunk_residency_seconds", "histogram", ("reason",),
              "Seconds a chunk stayed in the CPU tier (store to removal)."),
    MetricDef("kvobs_hits_evicted_before_load", "counter", ("reason",),
              "Chunks a lookup reported that were removed before the request's load pinned them (near misses)."),
    MetricDef("kvobs_history_chunks", "gauge", (), "Keys in the eviction history."),
    MetricDef("kvobs_history_window_seconds", "gauge", (), "How far back the eviction history reaches."),
    MetricDef("kvobs_dropped_records", "counter", ("stage",), "Records kvobs dropped to stay bounded."),
    MetricDef("kvobs_internal_errors", "counter", ("stage",),
              "Faults of kvobs's own (counted, never raised into vLLM)."),
    MetricDef("kvobs_recomputed_loads", "counter", (),
              "Failed loads survive mode turned into a recompute (the engine went on; 0 unless the option is on)."),
    MetricDef("kvobs_recomputed_tokens", "counter", (),
              "Tokens vLLM recomputed for those loads (what survive mode cost)."),
    MetricDef("kvobs_recompute_alarms", "counter", (),
              "Times recomputes exceeded the survive_alarm_per_hour option within an hour (logged at ERROR)."),
    MetricDef("kvobs_build_info", "gauge", ("version", "vllm_version", "hot_path"),
              "kvobs and vLLM versions and the hot path each engine runs (compiled or python)."),
    MetricDef("kvobs_observing", "gauge", ("reason",),
              "1 while kvobs observes the engine's offload manager, 0 when it stepped aside (reason: why)."),
    MetricDef("kvobs_engine_last_record_timestamp_seconds", "gauge", (),
              "Wall time of the newest record from each engine."),
    MetricDef("kvobs_last_load_failure_timestamp_seconds", "gauge", ("cause",),
              "Wall time of the newest failed load by cause (0: none); alerts read this, not when Prometheus "
              "first saw the counter move."),
    MetricDef("kvobs_previous_load_failure_timestamp_seconds", "gauge", ("cause",),
              "Wall time of the failed load before the newest, by cause (0: none): a repeat is both recent."),
    MetricDef("kvobs_sidecar_records", "counter", (), "Journal records the sidecar has read.", per_engine=False),
    MetricDef("kvobs_sidecar_skipped", "counter", ("source", "reason"),
              "Journal records and files the sidecar skipped (corrupt, or unreadable: another uid's, a symlink).",
              per_engine=False),
    MetricDef("kvobs_sidecar_internal_errors", "counter", (), "Ingest rounds that failed (logged once).",
              per_engine=False),
    MetricDef("kvobs_sidecar_build_info", "gauge", ("version",), "The sidecar's own kvobs version.",
              per_engine=False),
    MetricDef("kvobs_sidecar_unreadable_files", "gauge", (),
              "Files and directories of the kvobs directory the sidecar cannot read or write now "
              "(/healthz names them).", per_engine=False),
    MetricDef("kvobs_sidecar_engines", "gauge", (), "Engines the sidecar has seen.", per_engine=False),
    MetricDef("kvobs_sidecar_last_poll_timestamp_seconds", "gauge", (),
              "Wall time the last ingest round ended (0 until the first round ends).",
              per_engine=False),
)
METRIC: dict[str, MetricDef] = {m.name: m for m in METRICS}

SURVIVE_METRICS = {"loads": "kvobs_recomputed_loads", "tokens": "kvobs_recomputed_tokens",
                   "alarms": "kvobs_recompute_alarms"}
"""Survive mode's counts (``kvobs.codes.SURVIVE_COUNTS``) and the metric each is exported as."""

ON_VLLM = ("kvobs_evicted_chunks", "kvobs_load_failures", "kvobs_hits_evicted_before_load")
"""The counters the ``vllm_metrics`` option also puts on vLLM's own ``/metrics``, as
``vllm:kv_offload_`` + name (vLLM adds the engine labels itself)."""
VLLM_PREFIX = "vllm:kv_offload_"


def exposed_name(metric: MetricDef) -> str:
    """The name a scrape shows (a counter's with ``_total``; a histogram's series add their suffixes)."""
    return metric.name + "_total" if metric.type == "counter" else metric.name
