"""Every metric name and catalogued label value the dashboard and the rules use, from the catalogues.

kvobs's names come from kvobs/metric_catalogue.py (``METRICS``: the sidecar's; ``ON_VLLM`` and ``VLLM_ONLY``:
vLLM's ``/metrics`` as ``vllm:kv_offload_`` + name), vLLM's own from its ``VLLM_SERIES``, label values from
kvobs/codes.py through the catalogue. A name, suffix or label value the catalogue does not have raises
:class:`UnknownName` while generating: a wrong name never reaches the JSON or the YAML (DESIGN.md: metric
names are a contract). tests/unit/test_dashboard_json.py checks the generated files against the catalogue too.
"""

from __future__ import annotations

from kvobs.codes import CAUSES, DROP_STAGES, REASONS, STAGES, TIERS
from kvobs.metric_catalogue import (
    METRIC,
    ON_VLLM,
    VLLM_ONLY,
    VLLM_PREFIX,
    VLLM_SERIES_BY_NAME,
    MetricDef,
)

SUFFIXES: dict[str, tuple[str, ...]] = {"counter": ("total",), "gauge": ("",), "histogram": ("bucket", "sum", "count")}
"""The suffixes a scrape adds to a family's name, by type (a counter's ``_total``; a histogram's series)."""
LABEL_VALUES: dict[str, tuple[str, ...]] = {"reason": REASONS, "cause": CAUSES, "tier": TIERS,
                                            "stage": (*STAGES, *DROP_STAGES)}
"""kvobs.codes's values of a label, for a metric whose catalogue entry lists none (a histogram's reason)."""
VLLM_ONLY_METRIC: dict[str, MetricDef] = {metric.name: metric for metric in VLLM_ONLY}


class UnknownName(ValueError):
    """A name, suffix or label value that kvobs/metric_catalogue.py (or kvobs/codes.py) does not have."""


def _suffixed(name: str, type_: str, suffix: str) -> str:
    if suffix not in SUFFIXES[type_]:
        raise UnknownName(f"{name} is a {type_}: its series take the suffix {' or '.join(map(repr, SUFFIXES[type_]))}, "
                          f"not {suffix!r}")
    return f"{name}_{suffix}" if suffix else name


def m(name: str, suffix: str = "") -> str:
    """The sidecar's series of the catalogued metric ``name`` as a scrape shows it: ``m("kvobs_evicted_chunks",
    "total")`` is ``kvobs_evicted_chunks_total``; ``suffix`` "" for a gauge, one of bucket, sum, count for a
    histogram's series."""
    if name not in METRIC:
        raise UnknownName(f"{name!r} is not a metric of kvobs/metric_catalogue.py's METRICS")
    return _suffixed(name, METRIC[name].type, suffix)


def family(name: str) -> str:
    """The catalogued metric ``name`` as its family is named (a counter's without ``_total``): what a recording
    rule's name carries (``engine_reason:kvobs_evicted_chunks:rate5m``)."""
    if name not in METRIC:
        raise UnknownName(f"{name!r} is not a metric of kvobs/metric_catalogue.py's METRICS")
    return name


def on_vllm(name: str, suffix: str = "") -> str:
    """kvobs's metric ``name`` on vLLM's own /metrics (the kvobs option vllm_metrics): ``vllm:kv_offload_`` + name,
    for the catalogue's ``ON_VLLM`` counters and ``VLLM_ONLY`` gauges."""
    if name in ON_VLLM:
        metric = METRIC[name]
    elif name in VLLM_ONLY_METRIC:
        metric = VLLM_ONLY_METRIC[name]
    else:
        raise UnknownName(f"{name!r} is not on vLLM's /metrics (kvobs/metric_catalogue.py's ON_VLLM, VLLM_ONLY)")
    return VLLM_PREFIX + _suffixed(name, metric.type, suffix)


def vllm_own(name: str, suffix: str = "") -> str:
    """vLLM's own series ``name`` (``vllm:...``, as vLLM declares it) from kvobs/metric_catalogue.py's
    ``VLLM_SERIES``, the one table of vLLM's series kvobs shows but does not count."""
    if name not in VLLM_SERIES_BY_NAME:
        raise UnknownName(f"{name!r} is not in kvobs/metric_catalogue.py's VLLM_SERIES")
    return _suffixed(name, VLLM_SERIES_BY_NAME[name].type, suffix)


def since(name: str) -> str:
    """The first supported vLLM release that exports vLLM's series ``name``."""
    if name not in VLLM_SERIES_BY_NAME:
        raise UnknownName(f"{name!r} is not in kvobs/metric_catalogue.py's VLLM_SERIES")
    return VLLM_SERIES_BY_NAME[name].since


def matcher(name: str, label: str, value: str) -> str:
    """``label="value"`` for kvobs's metric ``name``: the label must be one of its catalogued labels and the value
    one of its catalogued values (kvobs.codes's, where the catalogue lists none for it)."""
    metric = METRIC.get(name) or VLLM_ONLY_METRIC.get(name)
    if metric is None:
        raise UnknownName(f"{name!r} is not in kvobs/metric_catalogue.py")
    if label not in metric.labels:
        raise UnknownName(f"{name} has no label {label!r} (its labels: {', '.join(metric.labels)})")
    values = metric.values or LABEL_VALUES.get(label, ())
    if value not in values:
        raise UnknownName(f"{value!r} is not a value of {name}'s {label} (kvobs/codes.py: {', '.join(values)})")
    return f'{label}="{value}"'
