"""The history and sidecar benchmarks run end to end at toy size (numbers meaningless; they must not rot)."""

from __future__ import annotations

from pathlib import Path

from benchmarks import history, sidecar


def test_history_benchmark_runs(tmp_path: Path) -> None:
    out = tmp_path / "history.json"
    results = history.main(["--quick", "--json", str(out)])
    small = results[str(results["sizes"][0])]
    assert small["memory"]["kvobs_bytes"] > 0 and small["recording"]["kvobs_keys_per_s"] > 0
    assert small["diagnosis"]["causes"] == {"coverage_mismatch": 4, "evicted_after_lookup": 12}
    assert out.read_text().startswith("{")


def test_sidecar_benchmark_runs() -> None:
    results = sidecar.main(["--quick"])
    assert results["ingest_batches_1..16"]["keys"] > 0
    assert results["metrics_idle_text"]["series"] > 100
