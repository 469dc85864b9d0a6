"""The fast /metrics renderer writes exactly what prometheus_client writes for the same state."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.exposition import generate_latest as text_latest
from prometheus_client.openmetrics.exposition import generate_latest as om_latest

from kvobs.sidecar.ingest import Ingest
from kvobs.sidecar.metrics import KvobsCollector
from kvobs.sidecar.render import Unsupported, fast_encoder, render_openmetrics, render_text

ENGINES = ["dp0", "dp1", 'we"ird\\name\nwith ünïcode']


def populated(tmp_path: Path) -> KvobsCollector:
    ingest = Ingest(tmp_path)
    state = ingest.state
    for n, engine in enumerate(ENGINES):
        state.apply({"k": "hello", "e": engine, "t": 1.0, "version": "0.1", "vllm_version": "0.33.0", "pid": 7})
        for i in range(20):
            state.apply({"k": "batch", "e": engine, "t": 2.0 + i, "r": ("capacity", "store_failed", "reset")[i % 3],
                         "g": {str(i % (n + 2)): 3}, "res": [0.0004 * i, 3.5 * i, 12345678.9 * i, 1e22]})
        state.apply({"k": "totals", "e": engine, "pid": 7, "t": 30.0,
                     "evicted": {"capacity": 123456789012, "store_failed": 2, "reset": 0},
                     "batches": {"capacity": 7}, "near": {"capacity": 1}, "failures": {"unknown": 2},
                     "errors": {"journal": 1}, "dropped": {"journal": 3}, "hist_keys": 1_000_000,
                     "hist_window": 3600.25})
        state.apply_report(f"r{n}", {"engine": engine, "missing": [
            {"group": 1, "cause": "evicted_after_lookup", "seconds_since_eviction": 0.5},
            {"group": 0, "cause": "coverage_mismatch", "seconds_since_eviction": None},
        ]})
    state.apply(None)  # a corrupt line, counted
    return KvobsCollector(ingest)


def test_text_and_openmetrics_bytes_match_prometheus_client(tmp_path: Path) -> None:
    collector = populated(tmp_path)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    text = render_text(collector.collect())
    assert text == text_latest(registry)
    assert render_openmetrics(collector.collect()) == om_latest(registry)
    assert text.count(b"\n") > 400 and b'engine="we\\"ird\\\\name\\nwith \xc3\xbcn' in text
    assert render_text(collector.collect()) == text  # second render, from the label cache


PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


@pytest.mark.parametrize(
    ("accept", "fast"),
    [
        ("", render_text),
        ("text/plain", render_text),
        (PROMETHEUS_ACCEPT, render_openmetrics),
        ("application/openmetrics-text", render_openmetrics),
        ("text/plain;version=1.0.0;escaping=underscores", render_text),
        ("text/plain;version=1.0.0;escaping=dots", None),
        ("application/openmetrics-text;version=1.0.0;escaping=allow-utf-8", None),
    ],
)
def test_fast_path_only_where_it_is_byte_identical(tmp_path: Path, accept: str, fast: object) -> None:
    encoder, _ = choose_encoder(accept)
    assert fast_encoder(encoder) is fast
    if fast is not None:
        collector = populated(tmp_path)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(collector)
        assert fast_encoder(encoder)(collector.collect()) == encoder(registry)  # type: ignore[misc]


def test_families_outside_the_plain_subset_are_left_to_prometheus_client() -> None:
    stamped = GaugeMetricFamily("kvobs_x", "x", labels=["a"])
    stamped.add_metric(["1"], 1.0, timestamp=5.0)
    with pytest.raises(Unsupported):
        render_text([stamped])
    with_unit = GaugeMetricFamily("kvobs_y_seconds", "y", unit="seconds")
    with pytest.raises(Unsupported):
        render_openmetrics([with_unit])
