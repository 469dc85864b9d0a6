"""The queries of the shipped Grafana dashboards, and Grafana's variable interpolation
(tests/integration/test_dashboards.py, test_dashboard_counts.py)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any


def panel_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, expr) for every panel target and annotation query."""
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            for target in inner.get("targets", []):
                yield f"panel {inner['title']!r} {target['refId']}", target["expr"]
    for annotation in dashboard["annotations"]["list"]:
        if "expr" in annotation:
            yield f"annotation {annotation['name']!r}", annotation["expr"]


def substitute(expr: str, values: dict[str, str]) -> str:
    """Grafana's interpolation: $var, ${var} and [[var]] forms."""
    out = re.sub(r"\$\{(\w+)\}|\$(\w+)|\[\[(\w+)\]\]", lambda m: values[m.group(1) or m.group(2) or m.group(3)], expr)
    assert "$" not in out, out
    return out
