"""Every ``kvobs_*`` metric, once: name, type, labels and their known values, help, and for each
engine counter where it is counted and the key it travels under in the journal's totals.

Everything that handles a counter iterates this table (stdlib only; cheap to import):

* the engine's counts: ``Observer.counts`` has one ``Counter`` per totals key (kvobs/observer.py);
* the journal's ``totals`` lines and their reader: ``kvobs.wire.format.TOTAL_KEYS``/``TOTAL_LABELS``;
* the sidecar's Prometheus collector (kvobs/sidecar/metrics.py);
* kvobs's opt-in counters on vLLM's own ``/metrics`` (kvobs/vllm/vllm_metrics.py, the entries with
  ``on_vllm``, under ``vllm:kv_offload_`` + name).

So adding an engine counter is an entry here plus the line that counts it, ``counts[<totals key>][<label value>]
+= n`` where it happens: in the recorder's fold (``Recorder.apply``, kvobs/hot_path.py) for what the taps
capture, in the observer for what it decides (a cause, a near miss). tests/unit/test_adding_a_counter.py adds one
so, end to end, and counts the files it touched: docs/design.md, "Where to change what".
Names are as prometheus_client's metric families take them: a counter's without its ``_total``
(exposed with it). The names and labels are a contract (DESIGN.md, README "Metrics", the
dashboards): add a metric here, never rename one.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

from kvobs.codes import CAUSES, DROP_STAGES, EXCEPTION_CAUSES, REASONS, STAGES, TIERS

ENGINE_LABELS = ("model_name", "engine")
"""vLLM's own identity labels, with vLLM's values: kvobs_* series join vllm:* series on them."""

UNKNOWN_WIRE = ("label_value", "counter", "field", "record_kind")
"""What a sidecar can meet in a journal that it does not know (a newer engine's): the ``what`` label of
``kvobs_sidecar_unknown_wire_items`` (kvobs/wire/decode.py keeps the rest of such a line)."""


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
    values: tuple[str, ...] = ()
    """The values of its (one) label that exist from the start, each a series from the first scrape
    (kvobs.codes). A reader exports values it does not know too (a newer engine's)."""
    totals: str = ""
    """An engine counter: the key of the journal's ``totals`` map it travels under (and of
    ``Observer.counts``); "" for everything else."""
    part: str = ""
    """An engine counter without labels: its entry in that totals map (several share one key)."""
    counted: str = ""
    """Where the engine counts it (the place to look when it does not move)."""
    on_vllm: bool = False
    """Also on vLLM's ``/metrics`` with the ``vllm_metrics`` option (kvobs/vllm/vllm_metrics.py)."""
    sep: str = ""
    """An engine counter with two labels: its totals map's keys are the first label's value, ``sep`` and the
    second's (:func:`split_key`); a key without ``sep`` (the pre-initialised ``values``) has the second ""."""

    @property
    def label_names(self) -> tuple[str, ...]:
        """Every label of a series, in order."""
        return (*ENGINE_LABELS, *self.labels) if self.per_engine else self.labels


METRICS: tuple[MetricDef, ...] = (
    MetricDef("kvobs_evicted_chunks", "counter", ("reason",), "Chunks removed from the CPU tier, by reason.",
              values=REASONS, totals="evicted", counted="Recorder._apply_removal (kvobs/hot_path.py)",
              on_vllm=True),
    MetricDef("kvobs_eviction_batches", "counter", ("reason",), "Removal batches from the CPU tier, by reason.",
              values=REASONS, totals="batches", counted="Recorder._apply_removal (kvobs/hot_path.py)"),
    MetricDef("kvobs_load_failures", "counter", ("cause",), "Failed prepare_load calls, by cause.",
              values=CAUSES, totals="failures", counted="Observer.report_failure (kvobs/observer.py)",
              on_vllm=True),
    MetricDef("kvobs_missing_chunks", "counter", ("cause", "group"),
              "Chunks missing at a failed load, by cause and KV group."),
    MetricDef("kvobs_missing_chunk_eviction_age_seconds", "histogram", ("group",),
              "Seconds between a missing chunk's last removal and the failed load."),
    MetricDef("kvobs_chunk_residency_seconds", "histogram", ("reason",),
              "Seconds a chunk stayed in the CPU tier (store to removal)."),
    MetricDef("kvobs_hits_evicted_before_load", "counter", ("reason",),
              "Chunks a lookup reported that were removed before the request's load pinned them (near misses).",
              values=REASONS, totals="near", counted="Observer.near_missed (kvobs/observer.py)", on_vllm=True),
    MetricDef("kvobs_history_chunks", "gauge", (), "Keys in the eviction history."),
    MetricDef("kvobs_history_window_seconds", "gauge", (), "How far back the eviction history reaches."),
    MetricDef("kvobs_stored_chunks", "counter", ("tier",),
              "Chunks stored into an offload tier from the GPU (a store the tier took: prepare_store's "
              "keys_to_store); promotions from a lower tier are not stores (kvobs_written_chunks counts both).",
              values=TIERS, totals="stored", counted="Recorder.apply, StoreTap's count (kvobs/hot_path.py)"),
    MetricDef("kvobs_loaded_chunks", "counter", ("tier",),
              "Chunks loaded back from an offload tier (prepare_load calls that succeeded), every read: a "
              "chunk read twice counts twice (kvobs_read_once_chunks counts it once).",
              values=TIERS, totals="loaded", counted="Recorder.mark_loaded, the fold of a load (kvobs/hot_path.py)"),
    MetricDef("kvobs_stored_bytes", "counter", ("tier",),
              "Bytes of tier capacity those stored chunks took (chunks times the spec's kv_bytes_per_chunk).",
              values=TIERS, totals="stored_bytes", counted="Recorder.apply (chunks x chunk_bytes)"),
    MetricDef("kvobs_loaded_bytes", "counter", ("tier",),
              "Bytes of tier capacity those loaded chunks held (chunks times the spec's kv_bytes_per_chunk).",
              values=TIERS, totals="loaded_bytes", counted="Recorder.mark_loaded (chunks x chunk_bytes)"),
    MetricDef("kvobs_written_chunks", "counter", ("tier",),
              "Chunks written into an offload tier by any path: stores from the GPU and promotions from a "
              "lower tier (the denominator of the read-back share, kvobs.codes.READ_BACK_SHARE).",
              values=TIERS, totals="written", counted="Recorder.apply, the fold of StoreTap's and WriteTap's counts"),
    MetricDef("kvobs_read_once_chunks", "counter", ("tier",),
              "Chunks read at least once since written into an offload tier, each counted at its first read "
              "(the numerator of the read-back share, kvobs.codes.READ_BACK_SHARE).",
              values=TIERS, totals="read_once", counted="Recorder.mark_loaded's read bits (kvobs/hot_path.py)"),
    MetricDef("kvobs_evicted_unread_chunks", "counter", ("reason",),
              "Chunks removed from the CPU tier never loaded since their store (write waste), by reason.",
              values=REASONS, totals="unread", counted="Recorder._apply_removal's read bits (kvobs/hot_path.py)"),
    MetricDef("kvobs_dropped_records", "counter", ("stage",), "Records kvobs dropped to stay bounded.",
              values=DROP_STAGES, totals="dropped",
              counted="JournalSink._enqueue (journal), Promises.reported (verdicts, kvobs/hot_promises.py), "
                      "the sidecar's SidecarState.apply (ingest: invalid text replaced)"),
    MetricDef("kvobs_capture_buffer_full", "counter", (),
              "Times a tap found kvobs's capture buffer full and applied it on vLLM's thread (nothing dropped; "
              "that call paid for the recording).",
              totals="capture", part="full", counted="Recorder._backlogged, on vLLM's thread (kvobs/hot_path.py)"),
    MetricDef("kvobs_internal_errors", "counter", ("stage",),
              "Faults of kvobs's own (counted, never raised into vLLM).",
              values=STAGES, totals="errors", counted="Observer.internal_error (kvobs/observer.py)"),
    MetricDef("kvobs_recomputed_loads", "counter", (),
              "Failed loads survive mode turned into a recompute (the engine went on; 0 unless the option is on).",
              totals="survive", part="loads", counted="RecomputeLedger.recomputed (kvobs/recompute_ledger.py)"),
    MetricDef("kvobs_recomputed_tokens", "counter", (),
              "Tokens vLLM recomputed for those loads (what survive mode cost).",
              totals="survive", part="tokens", counted="RecomputeLedger.recomputed (kvobs/recompute_ledger.py)"),
    MetricDef("kvobs_recompute_alarms", "counter", (),
              "Times recomputes exceeded the survive_alarm_per_hour option within an hour (logged at ERROR).",
              totals="survive", part="alarms", counted="RecomputeLedger.recomputed (kvobs/recompute_ledger.py)"),
    MetricDef("kvobs_offload_exceptions", "counter", ("cause", "site"),
              "Exceptions that left vLLM's offloading code through kvobs's connector, by cause (vllm_assertion, "
              "vllm_exception) and site (vLLM's file:function; \"\" on the pre-initialised series).",
              values=EXCEPTION_CAUSES, totals="exceptions", sep=" ",
              counted="kvobs.vllm.boundary.Boundary.count (kvobs/vllm/boundary.py)"),
    MetricDef("kvobs_build_info", "gauge", ("version", "vllm_version", "hot_path"),
              "kvobs and vLLM versions and the hot path each engine runs (compiled or python)."),
    MetricDef("kvobs_observing", "gauge", ("reason",),
              "1 while kvobs observes the engine's offload manager, 0 when it stepped aside (reason: why)."),
    MetricDef("kvobs_engine_last_record_timestamp_seconds", "gauge", (),
              "Wall time of the newest record from each engine."),
    MetricDef("kvobs_engine_start_timestamp_seconds", "gauge", (),
              "Wall time from which the engine's counters count: the earliest writer start (hello) the sidecar "
              "has read; count queries count a series new in their window in full when this is inside it."),
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
    MetricDef("kvobs_sidecar_unknown_wire_items", "gauge", ("what",),
              "Distinct label values, counters, fields and record kinds in the journals and reports this sidecar "
              "does not know (a newer engine's; the rest of each line is read, unknown label values exported).",
              per_engine=False, values=UNKNOWN_WIRE),
    MetricDef("kvobs_sidecar_last_poll_timestamp_seconds", "gauge", (),
              "Wall time the last ingest round ended (0 until the first round ends).",
              per_engine=False),
)
METRIC: dict[str, MetricDef] = {m.name: m for m in METRICS}

COUNTED: tuple[MetricDef, ...] = tuple(m for m in METRICS if m.totals)
"""The engine counters: those the journal's totals carry."""

TOTALS: dict[str, tuple[str, ...]] = {}
"""Totals key -> the label values (or, for counters without labels, the parts) it starts with."""
for _metric in COUNTED:
    TOTALS[_metric.totals] = (*TOTALS.get(_metric.totals, ()), *((_metric.part,) if _metric.part else _metric.values))
assert all(m.type == "counter" and (len(m.labels) == 1 or (len(m.labels) == 2 and m.sep)) != bool(m.part)
           for m in COUNTED), "an engine counter has one label (two joined by its sep), or no label and a part"


def new_counts() -> dict[str, Counter[str]]:
    """An engine's counters, one per totals key, every label value (or part) present from the start, so readers
    on other threads can copy them while they change (their size never does): ``Observer.counts``, which the
    recorder's fold and the observer count into (``counts[<totals key>][<label value>] += n``)."""
    return {key: Counter(dict.fromkeys(values, 0)) for key, values in TOTALS.items()}


def split_key(metric: MetricDef, key: str) -> list[str]:
    """A totals map's key as the counter's label values (two for a counter with a ``sep``)."""
    if not metric.sep:
        return [key]
    first, _, second = key.partition(metric.sep)
    return [first, second]

PARTS = ("dir", "flight_recorder")
"""The ``part`` label of ``kvobs_unavailable``: the parts of kvobs an option asks for that can fail to work."""

VLLM_ONLY: tuple[MetricDef, ...] = (
    MetricDef("kvobs_unavailable", "gauge", ("part",),
              "1 while a part of kvobs its options ask for does not work on this engine, else 0 (part: dir, the "
              "dir option's or KVOBS_DIR's directory is unusable: no journal, failure reports or replay bundles; "
              "flight_recorder, asked for by flight_calls and not recording).",
              values=PARTS, counted="Observer.unavailable (kvobs/observer.py)"),
)
"""Engine gauges only vLLM's ``/metrics`` carries (``vllm_metrics`` option, as ``vllm:kv_offload_`` + name), never
the sidecar: what they say matters most when the engine cannot write the directory the sidecar reads
(docs/design.md, "Mistakes that are loud"). Not in :data:`METRICS`, which is what the sidecar publishes."""

ON_VLLM = tuple(m.name for m in METRICS if m.on_vllm)
"""The counters the ``vllm_metrics`` option also puts on vLLM's own ``/metrics``, as
``vllm:kv_offload_`` + name (vLLM adds the engine labels itself)."""
VLLM_PREFIX = "vllm:kv_offload_"


def exposed_name(metric: MetricDef) -> str:
    """The name a scrape shows (a counter's with ``_total``; a histogram's series add their suffixes)."""
    return metric.name + "_total" if metric.type == "counter" else metric.name


class VllmSeries(NamedTuple):
    """One of vLLM's own series that kvobs's dashboard shows beside kvobs's (and never counts itself)."""

    name: str
    """As vLLM declares it (``vllm:...``; a counter's without ``_total``, which the scrape adds)."""
    type: str
    """``counter``, ``gauge`` or ``histogram``."""
    labels: tuple[str, ...]
    """Besides vLLM's :data:`ENGINE_LABELS` (``model_name``, ``engine``), which it carries first."""
    since: str
    """The first supported vLLM release that exports it (kvobs.versions.SUPPORTED_VLLM; all later ones do too)."""
    source: str
    """Where vLLM defines it, and when it exports it."""


VLLM_SERIES: tuple[VllmSeries, ...] = (
    # CPUOffloadingMetrics (vllm/v1/kv_offload/cpu/common.py; the CPU spec and the tiering spec, its subclass)
    VllmSeries("vllm:kv_offload_cpu_cache_usage_perc", "gauge", (), "0.30.0", "CPUOffloadingMetrics"),
    VllmSeries("vllm:kv_offload_cpu_cache_write_usage_perc", "gauge", (), "0.30.0", "CPUOffloadingMetrics"),
    VllmSeries("vllm:kv_offload_cpu_cache_read_usage_perc", "gauge", (), "0.30.0", "CPUOffloadingMetrics"),
    VllmSeries("vllm:kv_offload_cpu_allocation_size", "histogram", (), "0.30.0",
               "CPUOffloadingMetrics: CPU chunks each prepare_store call asks for"),
    VllmSeries("vllm:kv_offload_stores_skipped", "counter", (), "0.30.0",
               "CPUOffloadingMetrics, only with the CPU spec's store_threshold of 2 or more"),
    # The offloading connector's (vllm/distributed/kv_transfer/kv_connector/v1/offloading/metrics.py)
    VllmSeries("vllm:kv_offload_store_bytes", "counter", (), "0.30.0", "the offloading connector: GPU to offload"),
    VllmSeries("vllm:kv_offload_load_bytes", "counter", (), "0.30.0", "the offloading connector: offload to GPU"),
    VllmSeries("vllm:kv_offload_allocation_failure", "counter", (), "0.30.0", "the offloading connector"),
    VllmSeries("vllm:kv_offload_lookup_sync_delay_seconds", "histogram", (), "0.30.0", "the offloading connector"),
    # TieringOffloadingMetrics (vllm/v1/kv_offload/tiering/base.py; TieringOffloadingSpec only). vLLM's tier
    # label is "<index>:<type>" ("0:primary" the CPU tier, "1:fs" a first secondary tier).
    VllmSeries("vllm:kv_offload_tiering_read_bytes", "counter", ("tier",), "0.30.0",
               "TieringOffloadingMetrics: bytes promoted from a secondary tier into the CPU tier"),
    VllmSeries("vllm:kv_offload_tiering_write_bytes", "counter", ("tier",), "0.30.0",
               "TieringOffloadingMetrics: bytes cascaded from the CPU tier into a secondary tier"),
    VllmSeries("vllm:kv_offload_tiering_promotion_job_failures", "counter", ("tier",), "0.30.0",
               "TieringOffloadingMetrics"),
    VllmSeries("vllm:kv_offload_tiering_cascade_job_failures", "counter", ("tier",), "0.30.0",
               "TieringOffloadingMetrics"),
    VllmSeries("vllm:kv_offload_tiering_chunk_hits", "counter", ("tier",), "0.30.0", "TieringOffloadingMetrics"),
    VllmSeries("vllm:kv_offload_tiering_chunk_queries", "counter", ("tier",), "0.30.0", "TieringOffloadingMetrics"),
    VllmSeries("vllm:kv_offload_tiering_promotion_allocation_failures", "counter", (), "0.30.0",
               "TieringOffloadingMetrics"),
    VllmSeries("vllm:kv_offload_tiering_backpressure_stores_dropped", "counter", ("tier",), "0.31.0",
               "TieringOffloadingMetrics, with a back-pressure policy configured"),
    VllmSeries("vllm:kv_offload_tiering_backpressure_blocks_dropped", "counter", ("tier",), "0.31.0",
               "TieringOffloadingMetrics, with a back-pressure policy configured"),
    VllmSeries("vllm:kv_offload_tiering_backpressure_store_latency_ema", "gauge", ("tier",), "0.31.0",
               "TieringOffloadingMetrics, with a back-pressure policy configured"),
    VllmSeries("vllm:kv_offload_tiering_promotion_latency_seconds", "histogram", ("tier", "result"), "0.33.0",
               "TieringOffloadingMetrics, after a promotion"),
    # vLLM's engine stat logger (vllm/v1/metrics/loggers.py), the API server's: no offload spec needed
    VllmSeries("vllm:prompt_tokens_cached_by_source", "counter", ("source",), "0.32.0",
               "the stat logger: prefix-cache hit tokens by the tier that supplied them (device, host, disk, p2p, "
               "external_unspecified)"),
)
"""vLLM's own series kvobs shows but does not count: every ``vllm:`` series the dashboard reads besides kvobs's
own (``vllm:kv_offload_kvobs_*``, :data:`ON_VLLM` and :data:`VLLM_ONLY`), named here once (the dashboard's
panels take their names from here; tests/unit/test_dashboard_json.py checks the generated JSON against this
and, on the installed release, against vLLM's source). Where vLLM already exports a figure, kvobs shows vLLM's
series and exports no second count of it (README, "Is the tier doing anything")."""
VLLM_SERIES_BY_NAME: dict[str, VllmSeries] = {s.name: s for s in VLLM_SERIES}
