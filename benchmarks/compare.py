"""Compare: each ratio `make bench` measured against the committed baseline (benchmarks/baseline.json).

A report, not a gate: these machines are shared and noisy. Each row is a median of paired ratios with
its spread (half of max - min); a row *moved* when the new median and the baseline's differ by more
than the larger of the two spreads (and by more than ``FLOOR``, where a spread is tiny). Exit status 0
whatever moved; 2 if a result file or a row is missing.

    python -m benchmarks.compare [--results bench-results] [--baseline benchmarks/baseline.json] [--update]

``--update`` writes the results as the new baseline (commit it with the change that moved them).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from datetime import date
from pathlib import Path
from statistics import median
from typing import Any

from benchmarks._common import paired_ratios

FLOOR = 0.005
"""Differences below half a point are never called a move, however tight both spreads."""
BASELINE = Path(__file__).with_name("baseline.json")


def _overhead(manager: str, side: str, figure: str) -> Callable[[dict[str, Any]], list[float]]:
    def rows(data: dict[str, Any]) -> list[float]:
        samples = data[manager][figure]
        return paired_ratios(samples[side], samples["bare"])
    return rows


def _connector(manager: str) -> Callable[[dict[str, Any]], list[float]]:
    def rows(data: dict[str, Any]) -> list[float]:
        return paired_ratios(data[manager]["observed_s"], data[manager]["bare_s"])
    return rows


def _history_bytes(data: dict[str, Any]) -> list[float]:
    largest = max(data, key=lambda k: int(k) if k.isdigit() else -1)
    return [float(data[largest]["memory"]["kvobs_per_key"])]


ROWS: tuple[tuple[str, str, Callable[[dict[str, Any]], list[float]]], ...] = (
    ("overhead cpu: scheduler thread, observed", "overhead.json",
     _overhead("cpu", "observed", "interleaved_thread_s")),
    ("overhead cpu: process, observed", "overhead.json", _overhead("cpu", "observed", "interleaved_process_s")),
    ("overhead cpu: process, with the journal", "overhead.json",
     _overhead("cpu", "observed+journal", "interleaved_process_s")),
    ("overhead tiering: scheduler thread, observed", "overhead.json",
     _overhead("tiering", "observed", "interleaved_thread_s")),
    ("overhead tiering: process, observed", "overhead.json",
     _overhead("tiering", "observed", "interleaved_process_s")),
    ("overhead tiering: process, with the journal", "overhead.json",
     _overhead("tiering", "observed+journal", "interleaved_process_s")),
    ("connector cpu: observed / bare", "overhead_connector.json", _connector("cpu")),
    ("connector tiering: observed / bare", "overhead_connector.json", _connector("tiering")),
    ("history: bytes per key at the largest size", "history.json", _history_bytes),
)


def measure(results: Path) -> dict[str, dict[str, float]]:
    """Each row's median and spread from the JSON files in ``results`` (rows whose file is absent are left out)."""
    out: dict[str, dict[str, float]] = {}
    cache: dict[str, dict[str, Any] | None] = {}
    for name, file, samples_of in ROWS:
        if file not in cache:
            path = results / file
            cache[file] = json.loads(path.read_text()) if path.is_file() else None
        data = cache[file]
        if data is None:
            continue
        samples = samples_of(data)
        mid = median(samples)
        out[name] = {"median": mid, "spread": (max(samples) - min(samples)) / 2, "runs": len(samples)}
    return out


def verdict(now: dict[str, float], base: dict[str, float]) -> str:
    noise = max(now["spread"], base["spread"], FLOOR * base["median"])
    delta = now["median"] - base["median"]
    if abs(delta) <= noise:
        return "within noise"
    return "MOVED UP" if delta > 0 else "moved down"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path("bench-results"))
    parser.add_argument("--baseline", type=Path, default=BASELINE)
    parser.add_argument("--update", action="store_true", help="write these results as the baseline")
    args = parser.parse_args(argv)
    now = measure(args.results)
    if not now:
        print(f"compare: no benchmark results in {args.results} (run `make bench`)", file=sys.stderr)
        return 2
    if args.update:
        about = {"_about": f"benchmarks.compare --update, {date.today().isoformat()}, from {args.results}; "
                           "the conditions: docs/performance.md"}
        args.baseline.write_text(json.dumps({**about, **now}, indent=1, sort_keys=True) + "\n")
        print(f"compare: wrote {len(now)} rows to {args.baseline}")
        return 0
    if not args.baseline.is_file():
        print(f"compare: no baseline at {args.baseline} (`python -m benchmarks.compare --update` writes one)",
              file=sys.stderr)
        return 2
    base = json.loads(args.baseline.read_text())
    print(f"\nAgainst the baseline ({args.baseline}): medians of paired ratios, ± half their range\n")
    print(f"  {'row':46} {'baseline':>16} {'now':>16}   verdict")
    missing = 0
    for name, _, _ in ROWS:
        if name not in now or name not in base:
            print(f"  {name:46} {'-':>16} {'-':>16}   not measured {'now' if name not in now else 'in the baseline'}")
            missing += 1
            continue
        b, n = base[name], now[name]
        print(f"  {name:46} {b['median']:9.3f} ±{b['spread']:.3f} {n['median']:9.3f} ±{n['spread']:.3f}   "
              f"{verdict(n, b)}")
    return 2 if missing == len(ROWS) else 0


if __name__ == "__main__":
    sys.exit(main())
