"""kvobs's live counters on vLLM's own ``/metrics``: the opt-in ``vllm_metrics`` option.

vLLM lets an offloading spec publish metrics through its API server: the spec declares them
(``build_metric_definitions(extra_config)``, read by the API server's ``OffloadPromMetrics``),
and the manager's ``get_stats()`` returns their increments since its last call, which the
connector scheduler sends with each step's stats (kvobs/vllm/compat.py names the release
details). With the option on, the spec adds :func:`metric_definitions` to the inner spec's
declarations and the manager's ``get_stats`` (:class:`StatsTap`) adds kvobs's increments to
the inner manager's stats. Off, neither changes: kvobs declares and reports exactly what the
inner spec and manager do.

vLLM registers the names verbatim with its ``model_name`` and ``engine`` labels first and,
counters being prometheus_client's, exposes them with ``_total``::

    vllm:kv_offload_kvobs_evicted_chunks_total{model_name, engine, reason}
    vllm:kv_offload_kvobs_load_failures_total{model_name, engine, cause}
    vllm:kv_offload_kvobs_hits_evicted_before_load_total{model_name, engine, reason}

and, a gauge only vLLM's ``/metrics`` carries (kvobs/metric_catalogue.py's ``VLLM_ONLY``)::

    vllm:kv_offload_kvobs_unavailable{model_name, engine, part}

1 while a part of kvobs its options ask for does not work (``part="dir"``: the directory is unusable;
``part="flight_recorder"``: asked for, not recording): the sidecar cannot say so, since it learns of an
engine only from what the engine writes in that directory (docs/design.md, "Mistakes that are loud").

The counters count what the sidecar's ``kvobs_evicted_chunks_total``, ``kvobs_load_failures_total`` and
``kvobs_hits_evicted_before_load_total`` count (kvobs/sidecar/metrics.py), with the same help texts
(both from kvobs/metric_catalogue.py), under other names, so
that a query over one family never adds the other. The ``vllm:`` prefix also lets vLLM's
``unregister_vllm_metrics`` drop them with its own when its stat logger is rebuilt.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvobs.metric_catalogue import METRIC, ON_VLLM, VLLM_ONLY, VLLM_PREFIX
from kvobs.options import Options
from kvobs.vllm import compat

if TYPE_CHECKING:  # the API server imports this module for metric_definitions: no observer there
    from kvobs.observer import Observer

logger = logging.getLogger("kvobs")

PREFIX = VLLM_PREFIX + "kvobs_"
ON_VLLM_METRICS = tuple(METRIC[name] for name in ON_VLLM)
COUNTERS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = tuple(
    (VLLM_PREFIX + metric.name, metric.labels[0], metric.help, metric.values) for metric in ON_VLLM_METRICS
)
"""(name as declared, its label, help text, every label value): the catalogue's (kvobs/metric_catalogue.py)."""
GAUGES: tuple[tuple[str, str, str, tuple[str, ...]], ...] = tuple(
    (VLLM_PREFIX + metric.name, metric.labels[0], metric.help, metric.values) for metric in VLLM_ONLY
)
"""The same for the gauges only vLLM's ``/metrics`` carries (``kvobs_unavailable``)."""

_warned = False


def stats_api(options: Options) -> tuple[type[Any], type[Any]] | None:
    """vLLM's counter metadata and stats classes when ``options.vllm_metrics`` is on and this
    release has them; None otherwise, with one warning per process when the option asked for them."""
    global _warned
    if not options.vllm_metrics:
        return None
    api = compat.offload_stats_api()
    if isinstance(api, str):
        if not _warned:
            _warned = True
            logger.warning("kvobs option 'vllm_metrics' does nothing here: %s; kvobs's counters stay on "
                           "its sidecar only", api)
        return None
    return api


def metric_definitions(options: Options) -> dict[str, Any]:
    """What the spec adds to the inner spec's ``build_metric_definitions`` (empty when off)."""
    api = stats_api(options)
    if api is None:
        return {}
    counter_metadata = api[0]
    definitions: dict[str, Any] = {name: counter_metadata(documentation=doc, labelnames=(label,))
                                   for name, label, doc, _ in COUNTERS}
    gauge_metadata = compat.offload_gauge_api()
    if gauge_metadata is not None:
        definitions.update({name: gauge_metadata(documentation=doc, labelnames=(label,))
                            for name, label, doc, _ in GAUGES})
    return definitions


class StatsTap:
    """The manager's ``get_stats`` with the option on: the inner manager's stats, plus kvobs's
    counters' increments since the last call (every label value on the first, so each series
    exists from the engine's first stats; then only those that moved).

    Called by the connector scheduler (under the manager lock on 0.33). Never raises anything of
    its own: a fault is counted as kvobs's and the inner manager's stats are returned as they are.
    """

    def __init__(self, inner_get_stats: Callable[[], Any], observer: Observer, stats_cls: type[Any]) -> None:
        self._inner_get_stats = inner_get_stats
        self._observer = observer
        self._stats_cls = stats_cls
        self._last: dict[tuple[str, str], int] = {}
        self._gauges = compat.offload_gauge_api() is not None
        self._last_gauges: dict[tuple[str, str], int] = {}

    def __call__(self) -> Any:
        stats = self._inner_get_stats()
        try:
            increments = self.increments()
            gauges = self.gauge_changes() if self._gauges else []
            if increments or gauges:
                if stats is None:
                    stats = self._stats_cls()
                for name, value, delta in increments:
                    stats.increase_counter(name, delta, (value,))
                for name, value, level in gauges:
                    stats.set_gauge(name, level, (value,))
        except Exception as exc:  # kvobs never changes what vLLM gets because of its own fault
            self._observer.internal_error("sink", exc)
        return stats

    def gauge_changes(self) -> list[tuple[str, str, int]]:
        """(name, label value, value) of the gauges that changed since the last call (every one on the first:
        vLLM's gauge keeps its last value, so a payload each step is not needed)."""
        unavailable = self._observer.unavailable()
        out: list[tuple[str, str, int]] = []
        for name, _, _, values in GAUGES:
            for value in values:
                level = int(unavailable.get(value, False))
                if self._last_gauges.get((name, value)) != level:
                    self._last_gauges[(name, value)] = level
                    out.append((name, value, level))
        return out

    def totals(self) -> dict[str, dict[str, int]]:
        """kvobs's counters now, by declared name and label value (the observer's, by the catalogue's totals key)."""
        observer = self._observer  # only the counters it reports: this runs on the scheduler thread
        return {VLLM_PREFIX + metric.name: observer.counter(metric.totals) for metric in ON_VLLM_METRICS}

    def increments(self) -> list[tuple[str, str, int]]:
        """(name, label value, increment) since the last call; remembered as reported."""
        first = not self._last
        last = self._last
        out: list[tuple[str, str, int]] = []
        totals = self.totals()
        for name, _, _, values in COUNTERS:
            counts = totals[name]
            for value in values:
                now = int(counts.get(value, 0))
                delta = now - last.get((name, value), 0)
                if delta > 0 or first:
                    out.append((name, value, max(delta, 0)))
                    last[(name, value)] = now
        return out
