"""The dashboard and the rules read every metric name from the catalogue (issue 43, item 6; issue 41).

Every ``kvobs_*`` name in the generated JSON and YAML is a catalogued metric (kvobs/metric_catalogue.py) with a
suffix its type has, or kvobs's name on vLLM's /metrics (``vllm:kv_offload_`` + an ON_VLLM or VLLM_ONLY name);
every other ``vllm:`` series is in VLLM_SERIES, vLLM's own series kvobs shows but does not count; the generator
refuses a name the catalogue does not have."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dashboards import names
from dashboards.names import UnknownName, m, matcher, on_vllm, vllm_own
from kvobs.metric_catalogue import METRIC, ON_VLLM, VLLM_ONLY, VLLM_PREFIX, VLLM_SERIES, VLLM_SERIES_BY_NAME
from kvobs.versions import SUPPORTED_VLLM

ROOT = Path(__file__).resolve().parents[2]
GENERATED = [ROOT / "dashboards" / "kvobs-offload.json", *sorted((ROOT / "dashboards" / "rules").glob("*.yaml")),
             ROOT / "docker" / "k8s" / "base" / "grafana-dashboard.yaml",
             ROOT / "docker" / "k8s" / "base" / "prometheusrule.yaml"]
KVOBS_NAME = re.compile(r"(?<![\w.:])(?:vllm[:_]kv_offload_|vllm\[:_\]kv_offload_)?kvobs_[a-z0-9_]*[a-z0-9]")
VLLM_NAME = re.compile(r"vllm(?::|\[:_\])([a-z][a-z0-9_]*[a-z0-9])")


def series_names(metric: str, type_: str) -> set[str]:
    return {metric + (f"_{suffix}" if suffix else "") for suffix in names.SUFFIXES[type_]}


def known_kvobs() -> set[str]:
    known = {metric.name for metric in METRIC.values()}  # a family's name: recording rules carry it
    for metric in METRIC.values():
        known |= series_names(metric.name, metric.type)
    for metric in (*(METRIC[n] for n in ON_VLLM), *VLLM_ONLY):
        known |= {VLLM_PREFIX + n for n in series_names(metric.name, metric.type)}
    return known


def known_vllm() -> set[str]:
    known = set()
    for series in VLLM_SERIES:
        known |= {n.removeprefix("vllm:") for n in series_names(series.name, series.type)}
    return known


@pytest.mark.parametrize("path", GENERATED, ids=lambda p: p.name)
def test_every_kvobs_name_in_the_generated_files_is_catalogued(path: Path) -> None:
    text = path.read_text()
    found = {re.sub(r"^vllm(?:\[:_\]|_)", "vllm:", name) for name in KVOBS_NAME.findall(text)}
    assert found, path
    assert found - known_kvobs() == set(), f"{path.name}: names not in kvobs/metric_catalogue.py"


@pytest.mark.parametrize("path", GENERATED, ids=lambda p: p.name)
def test_every_other_vllm_series_is_in_the_table_of_vllms_own(path: Path) -> None:
    found = {n for n in VLLM_NAME.findall(path.read_text()) if not n.startswith("kv_offload_kvobs")}
    assert found - known_vllm() == set(), f"{path.name}: vLLM series not in VLLM_SERIES"


def test_the_dashboard_shows_vllms_tier_and_cache_series_beside_kvobss() -> None:
    board = (ROOT / "dashboards" / "kvobs-offload.json").read_text()
    for series in ("kv_offload_tiering_read_bytes_total", "kv_offload_tiering_write_bytes_total",
                   "kv_offload_cpu_allocation_size_sum", "prompt_tokens_cached_by_source_total"):
        assert f"vllm[:_]{series}" in board, series
    assert "kvobs does not count" in board or "not counted by kvobs" in board


def test_the_generator_refuses_unknown_names_suffixes_and_label_values() -> None:
    assert m("kvobs_evicted_chunks", "total") == "kvobs_evicted_chunks_total"
    assert m("kvobs_chunk_residency_seconds", "bucket") == "kvobs_chunk_residency_seconds_bucket"
    assert on_vllm("kvobs_unavailable") == "vllm:kv_offload_kvobs_unavailable"
    assert vllm_own("vllm:kv_offload_tiering_read_bytes", "total") == "vllm:kv_offload_tiering_read_bytes_total"
    assert matcher("kvobs_internal_errors", "stage", "report") == 'stage="report"'
    for bad in (lambda: m("kvobs_no_such_metric", "total"), lambda: m("kvobs_evicted_chunks"),
                lambda: m("kvobs_evicted_chunks_total"), lambda: m("kvobs_history_chunks", "total"),
                lambda: m("kvobs_chunk_residency_seconds", "total"), lambda: on_vllm("kvobs_stored_chunks", "total"),
                lambda: vllm_own("vllm:kv_offload_no_such"), lambda: matcher("kvobs_evicted_chunks", "cause", "x"),
                lambda: matcher("kvobs_evicted_chunks", "reason", "no_such_reason")):
        with pytest.raises(UnknownName):
            bad()


def test_an_unknown_name_fails_the_generation(monkeypatch: pytest.MonkeyPatch) -> None:
    from dashboards import generate
    from dashboards.config import load

    monkeypatch.delitem(METRIC, "kvobs_history_chunks")
    with pytest.raises(UnknownName, match="kvobs_history_chunks"):
        generate.outputs(load())


def test_vllms_own_series_are_in_the_installed_vllm_from_their_release() -> None:
    """The table's names are vLLM's, as the installed release declares them (where it is one it exports)."""
    vllm = pytest.importorskip("vllm")
    version = ".".join(vllm.__version__.split(".")[:3])
    if version not in SUPPORTED_VLLM:
        pytest.skip(f"vLLM {vllm.__version__} is not a supported release")
    source = "\n".join(p.read_text(errors="replace") for p in Path(vllm.__file__).parent.rglob("*.py"))
    assert all(s.since in SUPPORTED_VLLM and s.type in names.SUFFIXES for s in VLLM_SERIES)
    for series in VLLM_SERIES:
        exported = f'"{series.name}"' in source
        assert exported == (SUPPORTED_VLLM.index(version) >= SUPPORTED_VLLM.index(series.since)), series.name
    assert len(VLLM_SERIES_BY_NAME) == len(VLLM_SERIES)
