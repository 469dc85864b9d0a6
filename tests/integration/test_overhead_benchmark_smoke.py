"""The overhead benchmark runs end to end at toy size on the real managers (numbers meaningless)."""

from __future__ import annotations

from benchmarks import overhead


def test_overhead_benchmark_runs() -> None:
    results = overhead.main(["--quick"])  # also checks bare and observed replays give identical results
    for manager in ("cpu", "tiering"):
        assert results[manager]["calls"] > 500
        assert results[manager]["observed"]["thread_ratio"] > 0
