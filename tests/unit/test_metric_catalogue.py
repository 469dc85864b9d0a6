"""One metric catalogue (kvobs/metric_catalogue.py): what both exporters publish, and what README says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from kvobs import metric_catalogue
from kvobs.metric_catalogue import METRIC, METRICS, exposed_name
from kvobs.sidecar.ingest import Ingest
from kvobs.sidecar.metrics import KvobsCollector
from tests.support.removals import journal_one_removal

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_sidecar_publishes_every_catalogued_metric_as_catalogued(tmp_path: Path) -> None:
    journal_one_removal(tmp_path)
    ingest = Ingest(tmp_path)
    ingest.poll()
    families = {family.name: family for family in KvobsCollector(ingest).collect()}
    assert set(families) == set(METRIC)
    for name, family in families.items():
        metric = METRIC[name]
        assert (family.type, family.documentation) == (metric.type, metric.help), name
        assert family.samples, name
        for sample in family.samples:
            labels = tuple(k for k in sample.labels if k != "le")
            assert labels == metric.label_names, (name, sample.labels)


def test_the_catalogue_is_consistent_and_cheap() -> None:
    assert len(METRIC) == len(METRICS) and all(m.name.startswith("kvobs_") for m in METRICS)
    assert all(m.type in ("counter", "gauge", "histogram") and m.help.endswith(".") for m in METRICS)
    assert all(not m.name.endswith("_total") for m in METRICS)
    for metric in metric_catalogue.COUNTED:  # an engine counter: one label with its values, or a part of a map
        assert metric.counted and (metric.values if metric.labels else metric.part), metric.name
    assert metric_catalogue.TOTALS["survive"] == ("loads", "tokens", "alarms")
    assert all(METRIC[name].type == "counter" and len(METRIC[name].labels) == 1 for name in metric_catalogue.ON_VLLM)
    probe = ("import sys, kvobs.metric_catalogue; "
             "print(','.join(sorted(m for m in sys.modules if m.startswith(('kvobs.', 'numpy', 'vllm', "
             "'prometheus_client')))))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "kvobs.codes,kvobs.metric_catalogue"


def test_readmes_metrics_table_names_every_catalogued_metric_with_its_type_and_labels() -> None:
    text = README.read_text()
    table = text[text.index("### Metrics"):text.index("### Joining vLLM's series")]
    rows = [line for line in table.splitlines() if line.startswith("| `kvobs_")]
    named: dict[str, str] = {}
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        for name in re.findall(r"`(kvobs_[a-z_]+)(?:\{[^}]*\})?`", cells[0]):
            named[name] = row
    assert set(named) == {exposed_name(m) for m in METRICS}
    for metric in METRICS:
        row = named[exposed_name(metric)]
        assert metric.type in row, (metric.name, row)
        for label in metric.labels:
            assert f"`{label}`" in row or label in row.split("|")[1], (metric.name, label, row)
