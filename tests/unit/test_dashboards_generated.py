"""The checked-in dashboard and rules are what the generator writes (python -m dashboards.generate), and
the generator follows its configuration: a drift or a hand edit of the JSON/YAML fails here."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import yaml

from dashboards import generate
from dashboards.config import DEFAULT_PATH, load

ROOT = Path(__file__).resolve().parents[2]


def test_the_checked_in_files_are_what_the_code_generates(tmp_path: Path) -> None:
    written = generate.write(tmp_path, load())
    assert {p.relative_to(tmp_path).as_posix() for p in written} == {
        "kvobs-offload.json", "rules/kvobs-alerts.yaml", "rules/kvobs-recording.yaml"}
    for path in written:
        shipped = ROOT / "dashboards" / path.relative_to(tmp_path)
        assert shipped.read_text() == path.read_text(), (
            f"{shipped.relative_to(ROOT)} differs from the code: run python -m dashboards.generate")


def test_check_names_a_file_that_differs(tmp_path: Path, capsys: object) -> None:
    generate.write(tmp_path, load())
    assert generate.main(["--check", "--out", str(tmp_path)]) == 0
    alerts = tmp_path / "rules" / "kvobs-alerts.yaml"
    alerts.write_text(alerts.read_text().replace("severity: critical", "severity: warning"))
    assert generate.main(["--check", "--out", str(tmp_path)]) == 1
    assert generate.differing(tmp_path, load()) == [alerts]


def test_the_configuration_reaches_every_output(tmp_path: Path) -> None:
    """Another job, cluster label, data source variable and runbook base: each lands where it belongs and
    the defaults are gone (the configuration is the one source of these values)."""
    default = load()
    other = dataclasses.replace(default, job="kvobs-sidecar", cluster_label="k8s_cluster",
                                datasource_variable="prom", runbook_base="https://docs.example.com/kvobs/runbook.md")
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(dataclasses.asdict(other)))
    assert generate.main(["--config", str(config_path), "--out", str(tmp_path)]) == 0
    board = (tmp_path / "kvobs-offload.json").read_text()
    alerts = (tmp_path / "rules" / "kvobs-alerts.yaml").read_text()
    recording = (tmp_path / "rules" / "kvobs-recording.yaml").read_text()
    assert 'k8s_cluster=~\\"$cluster\\"' in board and not re.search(r'[^_]cluster=~', board)
    assert '"uid": "${prom}"' in board and "${datasource}" not in board
    variables = {v["name"]: v for v in json.loads(board)["templating"]["list"]}
    assert variables["job"]["current"]["value"] == "kvobs-sidecar" and variables["prom"]["type"] == "datasource"
    assert 'up{job="kvobs-sidecar"}' in alerts and 'up{job="kvobs"}' not in alerts
    assert "https://docs.example.com/kvobs/runbook.md#kvobsloadfailure" in alerts and default.runbook_base not in alerts
    assert "by (k8s_cluster, namespace, job" in recording and "by (cluster," not in recording.split("groups:")[1]
    # The count forms' joins too (dashboards/promql.py's Counts): no "on (cluster, ..." left anywhere.
    for text in (board, recording):
        joins = re.findall(r"on \(([^)]*)\)", text)
        assert joins and all(j.startswith("k8s_cluster,") for j in joins if "namespace" in j), joins


def test_the_configuration_file_is_complete() -> None:
    """Every field is in dashboards/config.yaml, nothing else is: no default hides in code."""
    raw = yaml.safe_load(DEFAULT_PATH.read_text())
    assert set(raw) == {f.name for f in dataclasses.fields(load())}
