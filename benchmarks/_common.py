"""Shared helpers: robust summaries, the printed table, JSON output, machine facts.

Why medians and interleaving: the machine is shared and noisy, so every
benchmark alternates baseline and kvobs runs (drift hits both alike) and reports
medians, plus the spread (min..max) so the reader can judge the noise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sample."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def spread(values: Sequence[float]) -> str:
    """Relative spread of a sample around its median, e.g. '±3.1%' (half of max-min)."""
    if len(values) < 2:
        return "n/a"
    mid = median(values)
    return f"±{50 * (max(values) - min(values)) / mid:.1f}%" if mid else "n/a"


def paired_ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    """Ratios of the i-th runs (taken next to each other, so drift cancels)."""
    return [n / d for n, d in zip(num, den, strict=True) if d > 0]


def machine() -> dict[str, Any]:
    """Facts about where the numbers were taken."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import numpy

    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "platform": platform.platform(),
        "loadavg_at_start": [round(x, 2) for x in load],
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A compact fixed-width table on stdout."""
    cells = [[str(c) for c in header], *[[_fmt(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for n, row in enumerate(cells):
        padded = (c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        print("  " + "  ".join(padded))
        if n == 0:
            print("  " + "  ".join("-" * w for w in widths))
    sys.stdout.flush()


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != value:  # nan
            return "n/a"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.3f}"
    return str(value)


def arg_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--runs", type=int, default=None, help="repeats per side (default: per benchmark)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--quick", action="store_true", help="toy sizes, for smoke tests (numbers meaningless)")
    return parser


def write_json(path: Path | None, name: str, results: dict[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "machine": machine(), **results}
    path.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
    print(f"\nwrote {path}")
