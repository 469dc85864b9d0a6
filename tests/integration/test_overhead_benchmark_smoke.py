"""The overhead benchmark runs end to end at toy size on the real managers (numbers meaningless)."""

from __future__ import annotations

from benchmarks import overhead


def test_overhead_benchmark_runs() -> None:
    results = overhead.main(["--quick"])  # also checks bare and observed replays give identical results
    for manager in ("cpu", "tiering"):
        assert results[manager]["calls"] > 500
        assert results[manager]["observed"]["thread_ratio"] > 0


def test_overhead_through_the_connector_benchmark_runs() -> None:
    from benchmarks import overhead_connector

    results = overhead_connector.main(["--quick", "--managers", "cpu"])
    assert results["cpu"]["requests"] > 0 and results["cpu"]["ratio"] > 0


def test_the_isolated_overhead_benchmark_runs() -> None:
    """benchmarks/isolated.py: each side replayed in a process of its own, the collector on (toy size)."""
    from benchmarks import isolated

    results = isolated.main(["--quick", "--workload", "prefix", "--sides",
                             "bare,observed,observed+flight,observed:held"])
    prefix = results["workloads"]["prefix"]
    assert all(r["internal_errors"] == 0 and r["calls"] > 100 for side in prefix["replays"].values() for r in side)
    assert prefix["observed"]["thread_ratio"] > 0 and prefix["bare"]["thread_ratio"] == 1.0
    # The side without kvobs's applier thread folds, after the replay, exactly what the served side folded.
    (served,), (held,) = prefix["replays"]["observed"], prefix["replays"]["observed:held"]
    assert served["folded"]["evicted"] > 0 and held["folded"] == served["folded"]
