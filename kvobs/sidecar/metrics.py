"""The Prometheus view of the sidecar's state (a custom collector, built per scrape); every metric's
name, type, labels and help come from :mod:`kvobs.metric_catalogue`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, Exemplar, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvobs import __version__
from kvobs.codes import CAUSES, REASONS
from kvobs.metric_catalogue import COUNTED, METRIC, split_key
from kvobs.sidecar.ingest import Ingest
from kvobs.wire.format import OTHER, kept_labels
from kvobs.wire.histogram import Histogram

SKIP_SOURCES = ("journal", "report", "checkpoint")
SKIP_REASONS = ("corrupt", "unreadable")


_FAMILIES: dict[str, Any] = {
    "counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "histogram": HistogramMetricFamily,
}


def _family(name: str) -> Any:
    """An empty family of the catalogued metric ``name`` (kvobs/metric_catalogue.py: type, labels, help)."""
    metric = METRIC[name]
    return _FAMILIES[metric.type](metric.name, metric.help, labels=list(metric.label_names))


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


def _values(known: tuple[str, ...], *seen: Iterable[str]) -> list[str]:
    """A label's values: the known ones (each a series from the start), then those a newer engine sent."""
    return [*known, *sorted({v for values in seen for v in values} - set(known))]


class KvobsCollector(Collector):
    """Every metric of DESIGN.md; every reason/cause/stage label value present from the start.

    Each engine's series carry ``model_name`` and ``engine`` as vLLM labels its own; the
    sidecar's own series (``kvobs_sidecar_*``) carry neither. The engine counters are
    kvobs/metric_catalogue.py's ``COUNTED``, read from the engine's summed totals by their totals key,
    with any label value a newer engine sent under its own value."""

    def __init__(self, ingest: Ingest) -> None:
        self.ingest = ingest

    def collect(self) -> Iterator[Metric]:
        counted = {metric.name: _family(metric.name) for metric in COUNTED}
        failures = counted["kvobs_load_failures"]
        missing = _family("kvobs_missing_chunks")
        age = _family("kvobs_missing_chunk_eviction_age_seconds")
        residency = _family("kvobs_chunk_residency_seconds")
        hist_chunks = _family("kvobs_history_chunks")
        hist_window = _family("kvobs_history_window_seconds")
        build = _family("kvobs_build_info")
        observing = _family("kvobs_observing")
        newest_failure = _family("kvobs_last_load_failure_timestamp_seconds")
        previous_failure = _family("kvobs_previous_load_failure_timestamp_seconds")
        last = _family("kvobs_engine_last_record_timestamp_seconds")
        started = _family("kvobs_engine_start_timestamp_seconds")
        ingest = self.ingest
        with ingest.lock:
            state = ingest.state
            for identity, stored in sorted(state.engines.items()):
                totals = stored.totals()
                latest = stored.latest()
                # Every cause of this engine: known, counted, or only in its reports (a newer engine's), one
                # bound over them all (kept_labels: the same series whatever the order things were read in).
                failures_in = totals.get("failures", {})
                kept = kept_labels({*failures_in, *stored.causes_seen()}, CAUSES)
                engine = stored.folded(kept, kept_labels(stored.groups, ()), kept_labels(stored.residency, REASONS))
                totals["failures"] = {}
                for cause, count in failures_in.items():
                    key = cause if cause in kept else OTHER
                    totals["failures"][key] = totals["failures"].get(key, 0.0) + count
                causes = _values(CAUSES, totals["failures"], engine.causes_seen())
                for metric in COUNTED:
                    counts = totals.get(metric.totals, {})
                    family = counted[metric.name]
                    if metric.part:
                        family.add_metric([*identity], counts.get(metric.part, 0))
                        continue
                    for value in causes if family is failures else _values(metric.values, counts):
                        exemplar = _exemplar(engine.exemplars.get(value)) if family is failures else None
                        family.add_metric([*identity, *split_key(metric, value)], counts.get(value, 0),
                                          exemplar=exemplar)
                for reason in _values(REASONS, engine.residency):
                    _hist(residency, [*identity, reason], engine.residency.get(reason))
                for cause in causes:
                    newest_t, previous_t = engine.failure_times.get(cause, (0.0, 0.0))
                    newest_failure.add_metric([*identity, cause], newest_t)
                    previous_failure.add_metric([*identity, cause], previous_t)
                    for group in sorted(engine.groups or {"0"}):
                        missing.add_metric([*identity, cause, group], engine.missing.get((cause, group), 0))
                for group in sorted(engine.groups or {"0"}):
                    _hist(age, [*identity, group], engine.missing_age.get(group))
                hist_chunks.add_metric([*identity], 0.0 if latest is None else latest.history_keys)
                hist_window.add_metric([*identity], 0.0 if latest is None else latest.history_window_s)
                hello = engine.hello
                if hello is not None:
                    build.add_metric([*identity, hello.version, hello.vllm_version, hello.hot_path], 1)
                    observing.add_metric([*identity, hello.reason], 1 if hello.observing else 0)
                last.add_metric([*identity], engine.last_record_time)
                if engine.started:  # unknown (no hello read): count queries fall back to the first scrape
                    started.add_metric([*identity], engine.started)
            skipped = dict(state.skipped)
            unknown = Counter(item.partition(":")[0] for item in state.unknown)
            records = state.records
            engines = len(state.engines)
            last_poll = ingest.last_poll
            ingest_errors = ingest.errors
            unreadable = len(ingest.unreadable)
        yield from counted.values()
        yield from (missing, age, residency, hist_chunks, hist_window)
        yield from (build, observing, last, started, newest_failure, previous_failure)
        ingested = _family("kvobs_sidecar_records")
        ingested.add_metric([], records)
        yield ingested
        skips = _family("kvobs_sidecar_skipped")
        for source in SKIP_SOURCES:
            for reason in SKIP_REASONS:
                skips.add_metric([source, reason], skipped.get((source, reason), 0))
        yield skips
        faults = _family("kvobs_sidecar_internal_errors")
        faults.add_metric([], ingest_errors)
        yield faults
        sidecar = _family("kvobs_sidecar_build_info")
        sidecar.add_metric([__version__], 1)
        yield sidecar
        blind = _family("kvobs_sidecar_unreadable_files")
        blind.add_metric([], unreadable)
        yield blind
        seen = _family("kvobs_sidecar_engines")
        seen.add_metric([], engines)
        yield seen
        strange = _family("kvobs_sidecar_unknown_wire_items")
        for what in METRIC["kvobs_sidecar_unknown_wire_items"].values:
            strange.add_metric([what], unknown.get(what, 0))
        yield strange
        poll = _family("kvobs_sidecar_last_poll_timestamp_seconds")
        poll.add_metric([], last_poll)
        yield poll
