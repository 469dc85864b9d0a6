"""The soak's parts that need no engine (benchmarks/soak.py): the slope test, durations, the seeded
traffic, the cause a defect's report must name."""

from __future__ import annotations

import itertools

import pytest

from benchmarks.soak import expected_cause, parse_duration
from benchmarks.soak_checks import flat, slope_interval_per_hour, slope_per_hour
from benchmarks.soak_workload import KINDS, actions


def test_the_slope_is_theil_sens_per_hour() -> None:
    assert slope_per_hour([0, 1800, 3600], [100, 105, 110]) == pytest.approx(10.0)
    assert slope_per_hour([0, 60, 120, 180], [5, 9, 5, 9]) == pytest.approx(3600 * (4 / 180) / 2)  # median of 6
    assert slope_per_hour([7], [1]) == 0.0
    assert slope_per_hour([7, 7], [1, 9]) == 0.0  # no two distinct times


def test_one_swing_at_an_end_does_not_make_a_leak() -> None:
    """The 10-minute soak failed once on a least-squares slope: vLLM's worker swung by ~350 MiB at the end of
    the run, on kvobs's engine and not the bare one's at that sample (issue 43)."""
    times = [40 * i for i in range(16)]
    bare = [900.0 + (i % 3) * 5 for i in range(16)]
    kvobs = [v + 20 for v in bare]
    kvobs[-1] += 350  # one swing
    least_squares_growth = 350 * (15 - 7.5) / sum((i - 7.5) ** 2 for i in range(16)) * 15
    assert least_squares_growth > 16  # what the old slope would have reported: a failure
    check, figures = flat("x", times, kvobs, bound_mib_per_hour=8, noise_mib=16, baseline_mib=bare)
    assert check.ok and abs(figures["fitted_growth_mib"]) < 1
    steady, _ = flat("x", times, [v + 2 * i for i, v in enumerate(kvobs)], bound_mib_per_hour=8, noise_mib=16,
                     baseline_mib=bare)
    assert not steady.ok  # a steady 2 MiB per sample (30 MiB over the run) still fails, swing or not


def test_growth_beyond_the_baseline_and_the_allowance_fails() -> None:
    times = [600 * i for i in range(13)]  # two hours
    bare = [1000 + 20 * i for i in range(13)]  # the engine's own growth, 120 MiB/h
    same, _ = flat("x", times, [v + 10 for v in bare], bound_mib_per_hour=8, noise_mib=16, baseline_mib=bare)
    leak, figures = flat("x", times, [v + 3 * i for i, v in enumerate(bare)], bound_mib_per_hour=8, noise_mib=16,
                         baseline_mib=bare)
    assert same.ok and not leak.ok  # 18 MiB/h beyond bare: 36 MiB over 2 h > max(16, 8 x 2)
    assert figures["fitted_growth_mib"] == pytest.approx(36.0) and figures["allowed_growth_mib"] == 16.0
    short, _ = flat("x", [0, 60, 120], [0, 5, 10], bound_mib_per_hour=8, noise_mib=16)
    assert short.ok  # 300 MiB/h, but 10 MiB over 2 minutes: within the noise a short run cannot resolve


def test_the_slopes_interval_holds_the_slope_and_closes_on_a_line() -> None:
    assert slope_interval_per_hour([0, 60, 120, 180], [0, 1, 2, 3]) == pytest.approx((60.0, 60.0))
    noisy = [900 + 7 * ((i * 5) % 3) for i in range(12)]
    low, high = slope_interval_per_hour([40 * i for i in range(12)], noisy)
    assert low < slope_per_hour([40 * i for i in range(12)], noisy) < high
    assert slope_interval_per_hour([5], [1]) == (0.0, 0.0)


def test_the_workers_drift_of_a_ci_run_is_not_a_leak_but_a_steady_one_is() -> None:
    """The 10-minute soak of CI (2026-12-06): EngineCore + worker, kvobs and bare, after warm-up. The point
    estimate of the growth beyond bare is over the allowance; the samples do not show it with 95% confidence
    (kvobs ended 3 MiB above bare, after starting 9 below: the workers' swings)."""
    times = [173, 217, 256, 295, 328, 361, 416, 458, 504, 542, 590, 606]
    kvobs = [1680, 1709, 1723, 1738, 1753, 1755, 1786, 1790, 1793, 1800, 1807, 1808]
    bare = [1689, 1724, 1730, 1747, 1763, 1778, 1790, 1795, 1796, 1796, 1805, 1805]
    check, figures = flat("x", times, kvobs, bound_mib_per_hour=8, noise_mib=16, baseline_mib=bare)
    assert figures["fitted_growth_mib"] > figures["allowed_growth_mib"] >= figures["growth_low_mib"]
    assert check.ok and "95%" in check.detail
    leak, figures = flat("x", times, [v + 0.05 * (t - times[0]) for v, t in zip(kvobs, times, strict=True)],
                         bound_mib_per_hour=8, noise_mib=16, baseline_mib=bare)
    assert not leak.ok and figures["growth_low_mib"] > 16  # 3 MiB a minute more, on top of the same drift


def test_durations() -> None:
    assert [parse_duration(t) for t in ("90", "90s", "10m", "2h", "1.5h")] == [90, 90, 600, 7200, 5400]
    with pytest.raises(ValueError):
        parse_duration("2 hours")


def test_the_traffic_is_seeded_and_has_every_kind() -> None:
    first, again = (list(itertools.islice(actions(7), 400)) for _ in range(2))
    assert first == again and first != list(itertools.islice(actions(8), 400))
    assert {a.kind for a in first} == set(KINDS)
    assert all(a.prompts for a in first if a.kind != "pause")
    assert max(len(p.split()) for a in first for p in a.prompts) < 800  # within the model's 1024 tokens


def test_the_cause_a_report_must_name_is_the_one_vllms_message_implies() -> None:
    assert expected_cause({"vllm_message": "Chunk b'x' not found in cache"}) == "evicted_after_lookup"
    assert expected_cause({"vllm_message": "Chunk b'x' is not ready for reading"}) == "store_in_flight"
    assert expected_cause({"vllm_message": "something else"}) is None
