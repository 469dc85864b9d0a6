"""The dashboard's series selectors and its read of kvobs's counters from either metrics path.

Three kinds of series, each with its own matchers (tests/unit/test_dashboard_json.py checks them):
kvobs's per-engine series (every variable), the sidecar's own (no model_name or engine: it has
neither), and vLLM's (no $job: vLLM has its own scrape job; both spellings of vLLM's names, as
Prometheus 2.x stores ``vllm:x`` as ``vllm_x`` when prometheus_client >= 0.26 answers its scrape).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dashboards.config import Config
from dashboards.names import m, on_vllm

VARIABLES = ("cluster", "namespace", "job", "model_name", "instance", "engine")
"""The dashboard's query variables after the data source, in order: each follows those before it."""
ENGINE_SERIES = (m("kvobs_build_info"), on_vllm("kvobs_evicted_chunks", "total"))
"""The series the per-engine variables read: the sidecar's build info, or kvobs's evictions on vLLM's
/metrics (the kvobs option vllm_metrics, kvobs/vllm/vllm_metrics.py)."""


def vllm(name: str) -> str:
    """vLLM's series ``vllm:<rest>`` by either spelling, as a metric-name regex (promql.series reads it)."""
    if not name.startswith("vllm:"):
        raise ValueError(f"not a name of vLLM's: {name!r}")
    return "vllm[:_]" + name.removeprefix("vllm:")


ENGINES = "|".join(vllm(name) if name.startswith("vllm:") else name for name in ENGINE_SERIES)
""":data:`ENGINE_SERIES` as one metric-name regex, vLLM's by either spelling."""


@dataclass(frozen=True)
class Selectors:
    """The label matchers of each kind of series, with the configuration's label names."""

    config: Config

    def _matchers(self, labels: tuple[str, ...]) -> str:
        names = {"cluster": self.config.cluster_label, "namespace": self.config.namespace_label}
        return ", ".join(f'{names.get(v, v)}="${v}"' if v == "job" else f'{names.get(v, v)}=~"${v}"'
                         for v in labels)

    @property
    def engine(self) -> str:
        """kvobs's per-engine series: every variable."""
        return self._matchers(VARIABLES)

    @property
    def sidecar(self) -> str:
        """The sidecar's own series and its ``up``: no model_name or engine."""
        return self._matchers(("cluster", "namespace", "job", "instance"))

    @property
    def vllm(self) -> str:
        """vLLM's series: not $job."""
        return self._matchers(("cluster", "namespace", "model_name", "instance", "engine"))

    @property
    def engine_id(self) -> str:
        """How a two-path read groups each path's series (instance kept: the panels show it)."""
        return f"{self.config.cluster_label}, {self.config.namespace_label}, instance, model_name, engine"

    @property
    def dedup_on(self) -> str:
        """What one engine's series of both paths share whatever the scrape set-up: not instance,
        which differs between the sidecar's target and vLLM's unless relabelled."""
        return f"{self.config.cluster_label}, {self.config.namespace_label}, model_name, engine"


Form = Callable[[str, str, str], str]
"""A read of a counter: (metric, selector, by) -> PromQL, e.g. ``Config.counts.count_per_step`` or :func:`rate`."""


def rate(metric: str, selector: str, by: str) -> str:
    """Per second over Grafana's $__rate_interval (four scrapes at least), summed ``by``."""
    from dashboards.promql import series

    return f"sum by ({by}) (rate({series(metric, selector)}[$__rate_interval]))"


def either_path(sel: Selectors, form: Form, counter: str, label: str) -> str:
    """kvobs's catalogued counter ``counter`` (``kvobs_<name>``, one of the catalogue's ON_VLLM) from the sidecar
    or, for an engine the sidecar does not export, from vLLM's /metrics (``vllm:kv_offload_kvobs_<name>``, the
    kvobs option vllm_metrics): per engine one path, never the sum of both. Grouped by the engine and ``label``."""
    by = f"{sel.engine_id}, {label}"
    sidecar = form(m(counter, "total"), sel.engine, by)
    vllm_side = form(vllm(on_vllm(counter, "total")), sel.vllm, by)
    return f"{sidecar} or ({vllm_side} unless on ({sel.dedup_on}) {m('kvobs_build_info')}{{{sel.engine}}})"
