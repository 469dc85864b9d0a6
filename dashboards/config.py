"""The generator's one configuration (dashboards/config.yaml): job, cluster and namespace labels,
data source, runbook base. Read once; every module takes a :class:`Config` instead of a constant."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

from dashboards.promql import Counts

HERE = Path(__file__).resolve().parent
DEFAULT_PATH = HERE / "config.yaml"


@dataclass(frozen=True)
class Config:
    job: str
    """The sidecar's scrape job: rules read kvobs's series with job="<job>"."""
    cluster_label: str
    namespace_label: str
    datasource_type: str
    datasource_variable: str
    runbook_base: str

    @property
    def datasource(self) -> dict[str, str]:
        """The data source every panel and query names: the variable, never a uid."""
        return {"type": self.datasource_type, "uid": "${" + self.datasource_variable + "}"}

    @property
    def identity(self) -> tuple[str, ...]:
        """The labels of one engine that every rule's aggregation keeps (two clusters never merge)."""
        return (self.cluster_label, self.namespace_label, "job", "instance", "model_name", "engine")

    @property
    def sidecar_identity(self) -> tuple[str, ...]:
        """One sidecar's scrape: its own series carry no model_name or engine."""
        return (self.cluster_label, self.namespace_label, "job", "instance")

    @property
    def counts(self) -> Counts:
        """dashboards/promql.py's count forms, joined on these labels."""
        return Counts(", ".join(self.identity), ", ".join(self.sidecar_identity))

    def runbook(self, alert: str) -> str:
        """The alert's runbook URL: GitHub's anchor of the "## <alert>" heading of docs/runbook.md."""
        return f"{self.runbook_base}#{alert.lower()}"


def load(path: Path = DEFAULT_PATH) -> Config:
    """The configuration in ``path``; every field is required (one source per value: the file)."""
    raw = yaml.safe_load(path.read_text())
    names = {f.name for f in dataclasses.fields(Config)}
    if not isinstance(raw, dict) or set(raw) != names:
        raise ValueError(f"{path}: wants exactly the keys {sorted(names)}, has {sorted(raw or {})}")
    return Config(**{k: str(v) for k, v in raw.items()})
