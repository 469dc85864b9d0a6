"""The soak's verdicts (benchmarks/soak.py): memory slopes and margins from the samples, and the checks' form.

Why a slope and not "last minus first": RSS moves with the allocator and the batch of the moment; a
line through every sample after warm-up is what grows steadily, and its slope in MiB per hour is the
figure a leak is judged by. The line is Theil-Sen's (the median of the slopes between every two
samples), not least squares': vLLM's CPU worker swings by hundreds of MiB from one sample to the next
(813-1,171 MiB in one 10-minute run, on the bare engine too), and one swing at an end of a short run
moved a least-squares slope past the allowance on its own. Against the bare engine, the slope judged
is that of the difference between the two engines' samples taken at the same times, process by process
(EngineCore, where kvobs's scheduler side and its bounded stores live, and the worker apart).

What fails is growth the samples show with 95% confidence, not the point estimate: the growth judged is
the lower end of the slope's 95% confidence interval (Sen's, from Kendall's statistic: a rank of the
pairwise slopes, no assumption on the noise's distribution). The worker's swings are vLLM's and move
the two engines' workers apart by tens of MiB for minutes at a time; the point estimate of their
difference crossed 16 MiB over 7.5 minutes in two 10-minute runs out of three while the kvobs worker ended
smaller than the bare one in the third. A steady leak moves every pairwise slope, so the interval's lower
end is about the slope itself. A short run cannot resolve a slow leak: growth is allowed up to the larger
of ``slope bound x hours`` and a fixed noise allowance (both stated in the report), so a 2-minute run
proves nothing below hundreds of MiB/hour, and a 2-hour run resolves ``slope bound``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


CONFIDENCE_Z = 1.96
"""The normal quantile of the slope's two-sided 95% confidence interval."""


def _pairwise_slopes(times_s: Sequence[float], values: Sequence[float]) -> list[float]:
    points = list(zip(times_s, values, strict=True))
    return sorted((v2 - v1) / (t2 - t1) for i, (t1, v1) in enumerate(points) for t2, v2 in points[i + 1:]
                  if t2 != t1)


def slope_per_hour(times_s: Sequence[float], values: Sequence[float]) -> float:
    """The Theil-Sen slope of ``values`` over ``times_s``, per hour: the median of the slopes between every
    two samples at distinct times (0 with fewer than 2 distinct times). A few outlying samples, however far
    out, do not move it."""
    slopes = _pairwise_slopes(times_s, values)
    if not slopes:
        return 0.0
    mid = len(slopes) // 2
    return 3600 * (slopes[mid] if len(slopes) % 2 else (slopes[mid - 1] + slopes[mid]) / 2)


def slope_interval_per_hour(times_s: Sequence[float], values: Sequence[float]) -> tuple[float, float]:
    """The 95% confidence interval of the Theil-Sen slope, per hour (Sen 1968): with N pairwise slopes and
    ``C = z * sqrt(n(n-1)(2n+5)/18)`` for n samples, the ``(N - C)/2``-th and ``(N + C)/2 + 1``-th smallest
    slopes. (0, 0) with fewer than 2 distinct times."""
    slopes = _pairwise_slopes(times_s, values)
    if not slopes:
        return 0.0, 0.0
    n, count = len(times_s), len(slopes)
    spread = CONFIDENCE_Z * math.sqrt(n * (n - 1) * (2 * n + 5) / 18)
    low = min(count - 1, max(0, math.floor((count - spread) / 2) - 1))
    high = max(0, min(count - 1, math.ceil((count + spread) / 2)))
    return 3600 * slopes[low], 3600 * slopes[high]


def allowed_growth_mib(window_s: float, bound_mib_per_hour: float, noise_mib: float) -> float:
    """The fitted growth over the window the flatness checks allow (see the module's docstring)."""
    return max(bound_mib_per_hour * window_s / 3600, noise_mib)


def flat(name: str, times_s: Sequence[float], values_mib: Sequence[float], *, bound_mib_per_hour: float,
         noise_mib: float, baseline_mib: Sequence[float] | None = None) -> tuple[Check, dict[str, float]]:
    """``values_mib`` do not grow beyond the allowance after warm-up, with 95% confidence (the lower end of
    the slope's interval, the module's docstring says why); with ``baseline_mib`` (the bare engine's, sampled
    at the same times) the growth judged is the excess over the baseline's."""
    slope = slope_per_hour(times_s, values_mib)
    base = slope_per_hour(times_s, baseline_mib) if baseline_mib is not None else 0.0
    judged = values_mib if baseline_mib is None else [v - b for v, b in zip(values_mib, baseline_mib, strict=True)]
    excess = slope if baseline_mib is None else slope_per_hour(times_s, judged)
    low, high = slope_interval_per_hour(times_s, judged)
    window = (times_s[-1] - times_s[0]) if times_s else 0.0
    growth, growth_low, growth_high = (x * window / 3600 for x in (excess, low, high))
    allowed = allowed_growth_mib(window, bound_mib_per_hour, noise_mib)
    figures = {"slope_mib_per_hour": slope, "baseline_slope_mib_per_hour": base, "window_s": window,
               "fitted_growth_mib": growth, "growth_low_mib": growth_low, "growth_high_mib": growth_high,
               "allowed_growth_mib": allowed}
    against = " beyond the bare engine's" if baseline_mib is not None else ""
    head = (f"{slope:+.1f} MiB/h over {window:.0f} s after warm-up (bare: {base:+.1f} MiB/h)"
            if baseline_mib is not None else f"{slope:+.1f} MiB/h over {window:.0f} s after warm-up")
    detail = (f"{head}; fitted growth{against} {growth:+.1f} MiB (95%: {growth_low:+.1f}..{growth_high:+.1f}), "
              f"allowed {allowed:.1f} MiB")
    return Check(name, len(times_s) >= 2 and growth_low <= allowed, detail), figures


def as_json(checks: Sequence[Check]) -> list[dict[str, Any]]:
    return [asdict(c) for c in checks]
