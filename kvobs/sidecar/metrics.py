"""The Prometheus view of the sidecar's state (a custom collector, built per scrape)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Exemplar, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvobs import __version__
from kvobs.codes import CAUSES, DROP_STAGES, REASONS, STAGES, SURVIVE_COUNTS
from kvobs.sidecar.ingest import Ingest
from kvobs.wire.histogram import Histogram

SKIP_SOURCES = ("journal", "report", "checkpoint")
ENGINE_LABELS = ("model_name", "engine")
"""vLLM's own identity labels, with vLLM's values: kvobs_* series join vllm:* series on them."""
SKIP_REASONS = ("corrupt", "unreadable")


def _hist(family: HistogramMetricFamily, labels: list[str], hist: Histogram | None) -> None:
    hist = hist or Histogram()
    family.add_metric(labels, hist.buckets(), hist.total)


def _exemplar(newest: tuple[str, float] | None) -> Exemplar | None:
    """The newest sampled failure of a series, as an OpenMetrics exemplar linking it to its trace
    (rendered only in OpenMetrics; the Prometheus text format has no exemplars)."""
    if newest is None:
        return None
    trace_id, when = newest
    return Exemplar({"trace_id": trace_id}, 1.0, when)


class KvobsCollector(Collector):
    """Every metric of DESIGN.md; every reason/cause/stage label value present from the start.

    Each engine's series carry ``model_name`` and ``engine`` as vLLM labels its own; the
    sidecar's own series (``kvobs_sidecar_*``) carry neither."""

    def __init__(self, ingest: Ingest) -> None:
        self.ingest = ingest

    def collect(self) -> Iterator[Metric]:
        evicted = CounterMetricFamily(
            "kvobs_evicted_chunks", "Chunks removed from the CPU tier.", labels=[*ENGINE_LABELS, "reason"]
        )
        batches = CounterMetricFamily(
            "kvobs_eviction_batches", "Removal batches from the CPU tier.", labels=[*ENGINE_LABELS, "reason"]
        )
        failures = CounterMetricFamily(
            "kvobs_load_failures", "Failed prepare_load calls by cause.", labels=[*ENGINE_LABELS, "cause"]
        )
        missing = CounterMetricFamily(
            "kvobs_missing_chunks",
            "Chunks missing at a failed load, by cause and KV group.",
            labels=[*ENGINE_LABELS, "cause", "group"],
        )
        age = HistogramMetricFamily(
            "kvobs_missing_chunk_eviction_age_seconds",
            "Seconds between a missing chunk's last removal and the failed load.",
            labels=[*ENGINE_LABELS, "group"],
        )
        residency = HistogramMetricFamily(
            "kvobs_chunk_residency_seconds",
            "Seconds a chunk stayed in the CPU tier (store to removal).",
            labels=[*ENGINE_LABELS, "reason"],
        )
        near = CounterMetricFamily(
            "kvobs_hits_evicted_before_load",
            "Chunks a lookup reported that were removed before the request's load pinned them (near misses).",
            labels=[*ENGINE_LABELS, "reason"],
        )
        hist_chunks = GaugeMetricFamily(
            "kvobs_history_chunks", "Keys in the eviction history.", labels=[*ENGINE_LABELS]
        )
        hist_window = GaugeMetricFamily(
            "kvobs_history_window_seconds", "How far back the eviction history reaches.", labels=[*ENGINE_LABELS]
        )
        dropped = CounterMetricFamily(
            "kvobs_dropped_records", "Records kvobs dropped to stay bounded.", labels=[*ENGINE_LABELS, "stage"]
        )
        errors = CounterMetricFamily(
            "kvobs_internal_errors",
            "Faults of kvobs's own (counted, never raised into vLLM).",
            labels=[*ENGINE_LABELS, "stage"],
        )
        build = GaugeMetricFamily(
            "kvobs_build_info",
            "kvobs and vLLM versions and the hot path each engine runs (compiled or python).",
            labels=[*ENGINE_LABELS, "version", "vllm_version", "hot_path"],
        )
        observing = GaugeMetricFamily(
            "kvobs_observing",
            "1 while kvobs observes the engine's offload manager, 0 when it stepped aside (reason: why).",
            labels=[*ENGINE_LABELS, "reason"],
        )
        newest_failure = GaugeMetricFamily(
            "kvobs_last_load_failure_timestamp_seconds",
            "Wall time of the newest failed load by cause (0: none); alerts read this, not when Prometheus "
            "first saw the counter move.",
            labels=[*ENGINE_LABELS, "cause"],
        )
        previous_failure = GaugeMetricFamily(
            "kvobs_previous_load_failure_timestamp_seconds",
            "Wall time of the failed load before the newest, by cause (0: none): a repeat is both recent.",
            labels=[*ENGINE_LABELS, "cause"],
        )
        survive = {
            "loads": CounterMetricFamily(
                "kvobs_recomputed_loads",
                "Failed loads survive mode turned into a recompute (the engine went on; 0 unless the option is on).",
                labels=[*ENGINE_LABELS],
            ),
            "tokens": CounterMetricFamily(
                "kvobs_recomputed_tokens", "Tokens vLLM recomputed for those loads (what survive mode cost).",
                labels=[*ENGINE_LABELS],
            ),
            "alarms": CounterMetricFamily(
                "kvobs_recompute_alarms",
                "Times recomputes exceeded the survive_alarm_per_hour option within an hour (logged at ERROR).",
                labels=[*ENGINE_LABELS],
            ),
        }
        assert tuple(survive) == SURVIVE_COUNTS
        last = GaugeMetricFamily(
            "kvobs_engine_last_record_timestamp_seconds",
            "Wall time of the newest record from each engine.",
            labels=[*ENGINE_LABELS],
        )
        ingest = self.ingest
        with ingest.lock:
            state = ingest.state
            for identity, engine in sorted(state.engines.items()):
                totals = engine.totals()
                latest = engine.latest()
                for reason in REASONS:
                    evicted.add_metric([*identity, reason], totals.get("evicted", {}).get(reason, 0))
                    batches.add_metric([*identity, reason], totals.get("batches", {}).get(reason, 0))
                    near.add_metric([*identity, reason], totals.get("near", {}).get(reason, 0))
                    _hist(residency, [*identity, reason], engine.residency.get(reason))
                for cause in CAUSES:
                    failures.add_metric([*identity, cause], totals.get("failures", {}).get(cause, 0),
                                        exemplar=_exemplar(engine.exemplars.get(cause)))
                    newest_t, previous_t = engine.failure_times.get(cause, (0.0, 0.0))
                    newest_failure.add_metric([*identity, cause], newest_t)
                    previous_failure.add_metric([*identity, cause], previous_t)
                    for group in sorted(engine.groups or {"0"}):
                        missing.add_metric([*identity, cause, group], engine.missing.get((cause, group), 0))
                for group in sorted(engine.groups or {"0"}):
                    _hist(age, [*identity, group], engine.missing_age.get(group))
                for stage in DROP_STAGES:
                    dropped.add_metric([*identity, stage], totals.get("dropped", {}).get(stage, 0))
                for stage in STAGES:
                    errors.add_metric([*identity, stage], totals.get("errors", {}).get(stage, 0))
                for count, family in survive.items():
                    family.add_metric([*identity], totals.get("survive", {}).get(count, 0))
                hist_chunks.add_metric([*identity], 0.0 if latest is None else latest.history_keys)
                hist_window.add_metric([*identity], 0.0 if latest is None else latest.history_window_s)
                hello = engine.hello
                if hello is not None:
                    build.add_metric([*identity, hello.version, hello.vllm_version, hello.hot_path], 1)
                    observing.add_metric([*identity, hello.reason], 1 if hello.observing else 0)
                last.add_metric([*identity], engine.last_record_time)
            skipped = dict(state.skipped)
            records = state.records
            engines = len(state.engines)
            last_poll = ingest.last_poll
            ingest_errors = ingest.errors
            unreadable = len(ingest.unreadable)
        yield from (
            evicted,
            batches,
            failures,
            missing,
            age,
            residency,
            near,
            hist_chunks,
            hist_window,
            dropped,
            errors,
            *survive.values(),
        )
        yield from (build, observing, last, newest_failure, previous_failure)
        ingested = CounterMetricFamily("kvobs_sidecar_records", "Journal records the sidecar has read.")
        ingested.add_metric([], records)
        yield ingested
        skips = CounterMetricFamily(
            "kvobs_sidecar_skipped",
            "Journal records and files the sidecar skipped (corrupt, or unreadable: another uid's, a symlink).",
            labels=["source", "reason"],
        )
        for source in SKIP_SOURCES:
            for reason in SKIP_REASONS:
                skips.add_metric([source, reason], skipped.get((source, reason), 0))
        yield skips
        faults = CounterMetricFamily("kvobs_sidecar_internal_errors", "Ingest rounds that failed (logged once).")
        faults.add_metric([], ingest_errors)
        yield faults
        sidecar = GaugeMetricFamily("kvobs_sidecar_build_info", "The sidecar's own kvobs version.", labels=["version"])
        sidecar.add_metric([__version__], 1)
        yield sidecar
        blind = GaugeMetricFamily(
            "kvobs_sidecar_unreadable_files",
            "Files and directories of the kvobs directory the sidecar cannot read or write now (/healthz names them).",
        )
        blind.add_metric([], unreadable)
        yield blind
        seen = GaugeMetricFamily("kvobs_sidecar_engines", "Engines the sidecar has seen.")
        seen.add_metric([], engines)
        yield seen
        poll = GaugeMetricFamily("kvobs_sidecar_last_poll_timestamp_seconds", "Wall time of the last ingest round.")
        poll.add_metric([], last_poll)
        yield poll
