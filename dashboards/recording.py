"""kvobs's recording rules (dashboards/rules/kvobs-recording.yaml), as data.

Naming: level:metric:operations (https://prometheus.io/docs/practices/rules/). "engine" is the level:
every rule keeps the engine's identity (:attr:`Config.identity`) plus the label named after it (reason,
cause). The count (``:increase1h``) is :meth:`dashboards.promql.Counts.increase_rule`'s exact form.
"""

from __future__ import annotations

from typing import Any

from dashboards.config import Config
from dashboards.names import family, m

COMMENT = """\
# kvobs recording rules: aggregations for alerts, ad-hoc queries and one dashboard panel ("Near misses
# and failures per engine"; the dashboard's other panels read the raw series and work without them).
# Naming: level:metric:operations (https://prometheus.io/docs/practices/rules/). "engine" is the level:
# every rule keeps cluster and namespace (so Thanos/Mimir never merge clusters), job and instance (the
# scrape), model_name and engine (vLLM's labels, exported by the sidecar), plus the label named after it
# (reason, cause). engine_cause:kvobs_load_failures:increase1h is an exact count (dashboards/promql.py),
# not increase()'s extrapolation. docker/k8s/base/prometheusrule.yaml carries these groups too.
"""


def rules(config: Config) -> dict[str, Any]:
    """The rule file's document."""
    engine = ", ".join(config.identity)

    def quantile(q: float, metric: str, by: str, window: str) -> str:
        return f"histogram_quantile({q},\n  sum by (le, {by}) (rate({m(metric, 'bucket')}[{window}])))\n"

    def name(level: str, metric: str, operation: str) -> str:
        """level:metric:operations, the metric's catalogued family name."""
        return f"{level}:{family(metric)}:{operation}"

    return {"groups": [{"name": "kvobs.recording", "rules": [
        {"record": name("engine_reason", "kvobs_evicted_chunks", "rate5m"),
         "expr": f"sum by ({engine}, reason) (rate({m('kvobs_evicted_chunks', 'total')}[5m]))"},
        {"record": name("engine_reason", "kvobs_hits_evicted_before_load", "rate5m"),
         "expr": f"sum by ({engine}, reason) (rate({m('kvobs_hits_evicted_before_load', 'total')}[5m]))"},
        {"record": name("engine_cause", "kvobs_load_failures", "increase1h"),
         "expr": config.counts.increase_rule(m("kvobs_load_failures", "total"), f"{engine}, cause", "1h")},
        {"record": name("engine_reason", "kvobs_chunk_residency_seconds", "p50_rate5m"),
         "expr": quantile(0.5, "kvobs_chunk_residency_seconds", f"{engine}, reason", "5m")},
        {"record": name("engine_reason", "kvobs_chunk_residency_seconds", "p99_rate5m"),
         "expr": quantile(0.99, "kvobs_chunk_residency_seconds", f"{engine}, reason", "5m")},
        {"record": name("engine", "kvobs_missing_chunk_eviction_age_seconds", "p99_rate1h"),
         "expr": quantile(0.99, "kvobs_missing_chunk_eviction_age_seconds", engine, "1h")},
    ]}]}
