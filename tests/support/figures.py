"""Figures the reliability tests measure, printed at the end of the pytest run (docs/reliability.md)."""

from __future__ import annotations

from collections import Counter
from typing import Any

COUNTS: Counter[str] = Counter()
"""How many sequences / operations / failed loads the property tests tried, per configuration."""

MEASURED: dict[str, Any] = {}
"""One-off measurements: flush bounds, RSS under HTTP abuse, ..."""


def lines() -> list[str]:
    out = [f"{name}: {value}" for name, value in sorted(COUNTS.items())]
    out += [f"{name}: {value}" for name, value in sorted(MEASURED.items())]
    return out
