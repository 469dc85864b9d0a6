"""benchmarks/compare.py: a row moves only beyond the larger spread, and the baseline round-trips."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.compare import main, measure, verdict


def _overhead(ratio: float, jitter: float) -> dict[str, object]:
    bare = [1.0, 1.1, 0.9]
    side = {"bare": bare, "observed": [b * (ratio + d) for b, d in zip(bare, (-jitter, 0.0, jitter), strict=True)],
            "observed+journal": [b * 1.2 for b in bare]}
    return {m: {"interleaved_thread_s": side, "interleaved_process_s": side} for m in ("cpu", "tiering")}


def test_a_row_moves_only_beyond_the_larger_spread() -> None:
    base = {"median": 1.10, "spread": 0.01}
    assert verdict({"median": 1.105, "spread": 0.002}, base) == "within noise"
    assert verdict({"median": 1.15, "spread": 0.002}, base) == "MOVED UP"
    assert verdict({"median": 1.05, "spread": 0.002}, base) == "moved down"
    assert verdict({"median": 1.15, "spread": 0.06}, base) == "within noise"  # a noisy run proves nothing


def test_the_baseline_is_written_and_compared(tmp_path: Path, capsys: object) -> None:
    results = tmp_path / "results"
    results.mkdir()
    (results / "overhead.json").write_text(json.dumps(_overhead(1.10, 0.005)))
    baseline = tmp_path / "baseline.json"
    assert main(["--results", str(results), "--baseline", str(baseline), "--update"]) == 0
    assert measure(results)["overhead cpu: scheduler thread, observed"]["median"] == 1.10
    (results / "overhead.json").write_text(json.dumps(_overhead(1.30, 0.005)))
    assert main(["--results", str(results), "--baseline", str(baseline)]) == 0
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    moved = [line for line in out.splitlines() if "scheduler thread, observed" in line]
    assert all("MOVED UP" in line for line in moved) and len(moved) == 2
    assert "connector cpu: observed / bare" in out and "not measured" in out


def test_no_results_is_an_error(tmp_path: Path) -> None:
    assert main(["--results", str(tmp_path), "--baseline", str(tmp_path / "b.json")]) == 2
