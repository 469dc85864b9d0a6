"""PromQL that counts events from counters, right for series that start, restart or go stale in a window.

``x - x offset R`` returns nothing for a series that has no sample at the window's start (a new pod, an
engine the sidecar first sees, a scrape gap, a Prometheus restarted without its storage), so a failure
in a series' first scrape was counted nowhere. ``increase(x[R])`` has the same blind spot (it only
sees the difference between samples inside the window) and extrapolates to a fraction.

The forms here count **each event at the first scrape that shows it** and are plain differences of
counter values (integers, no extrapolation):

    count = end - start
    end   = the newest value in the window (``max_over_time``: a counter only grows, and a sidecar
            restarted from an older checkpoint dips for a scrape without this counting it twice)
    start = the value at the window's start: the newest sample before it, within ``lookback``
            (a sidecar restart or scrape gap in between changes nothing: the sidecar resumes its
            counters from its checkpoint and the journals, and the gap's events are counted once,
            at the first scrape after it), else
            0 when the engine started after the last scrape Prometheus has of its sidecar before the
            window (that scrape's ``kvobs_sidecar_last_poll_timestamp_seconds``; with none, after
            the window's start) by ``kvobs_engine_start_timestamp_seconds``, the earliest writer
            start the sidecar has read: every event of the engine was first shown inside the window,
            so a new pod, a new engine, a counter already non-zero at its first scrape count in
            full, else
            0 when Prometheus knew the engine at the window's start but not this series (a label
            value first seen inside the window), else
            the first value seen in the window (Prometheus knows nothing of the engine before it:
            restarted without storage, or a gap longer than ``lookback``; events between the
            window's start and that first scrape are not counted: the one approximation).

Counters on vLLM's own ``/metrics`` (``vllm:kv_offload_*``) have no start time and reset when vLLM
restarts: there ``start`` is the sample before the window, else the first in it, and a step whose
value fell counts its end value (one reset a step, from 0).

Step-wise (``count_per_step``), the end of one step is the start of the next, so each event is in
exactly one step and the steps add up to the window's count.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from dashboards.names import m

ENGINE_START = m("kvobs_engine_start_timestamp_seconds")
"""The sidecar's per-engine gauge of when the engine's counters began (kvobs/metric_catalogue.py)."""
SIDECAR_POLL = m("kvobs_sidecar_last_poll_timestamp_seconds")
"""When the sidecar's last ingest round ended: what a scrape of it had read (0 before its first round)."""
LOOKBACK = "1h"
"""How far before a window's start a counter's last value is looked for: longer than any scrape gap
one expects to bridge (a sidecar or Prometheus restart); bounds each evaluation's cost."""

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def series(metric: str, selector: str = "") -> str:
    """``metric{selector}``; a metric that is not a plain name is a regex of names (``vllm[:_]...``)."""
    if _NAME.fullmatch(metric):
        return f"{metric}{{{selector}}}" if selector else metric
    return "{" + ", ".join(p for p in (f'__name__=~"{metric}"', selector) if p) + "}"


def seconds(duration: str) -> int:
    """A PromQL duration ("1h", "90m", "1h30m") in seconds."""
    parts = re.findall(r"(\d+)([smhdw])", duration)
    if not parts or "".join(n + u for n, u in parts) != duration:
        raise ValueError(f"not a PromQL duration of s/m/h/d/w: {duration!r}")
    return sum(int(n) * _UNITS[u] for n, u in parts)


def _sum(by: str, expr: str) -> str:
    return f"sum by ({by}) ({expr})" if by else f"sum ({expr})"


class Counts(NamedTuple):
    """The count forms, joined on the configuration's labels (dashboards/config.py: ``Config.counts``)."""

    engine_on: str
    """The labels that identify one engine's series from one sidecar (the sidecar's scrape keeps them)."""
    sidecar_on: str
    """The labels that identify one sidecar's scrape."""

    def counted(self, metric: str, selector: str, window: str, since: str, lookback: str = LOOKBACK) -> str:
        """Events of each series of ``metric{selector}`` in the ``window`` ending at the evaluation time,
        which began at ``since`` (a PromQL scalar expression of Unix seconds: ``time() - <window in s>``).
        One series a series, no aggregation (see the module's docstring for what is exact)."""
        sel = series(metric, selector)
        if metric.startswith("kvobs_"):
            end = f"max_over_time({sel}[{window}])"
            began = f"min_over_time({ENGINE_START}[{window}])"
            polled = f"max_over_time({SIDECAR_POLL}[{lookback}] offset {window})"
            new = f"{began} > on ({self.sidecar_on}) group_left {polled} or {began} > {since}"
            start = (f"max_over_time({sel}[{lookback}] offset {window})"
                     f" or (0 * {end} and on ({self.engine_on}) ({new}))"
                     f" or (0 * {end} and on ({self.engine_on})"
                     f" max_over_time({ENGINE_START}[{lookback}] offset {window}))"
                     f" or min_over_time({sel}[{window}])")
            return f"clamp_min({end} - ({start}), 0)"
        # vLLM's own counters: reset on a vLLM restart, no start time.
        end = f"last_over_time({sel}[{window}])"
        start = f"last_over_time({sel}[{lookback}] offset {window}) or min_over_time({sel}[{window}])"
        return f"(({end} - ({start})) >= 0 or {end})"


    def count_in_range(self, metric: str, selector: str, by: str) -> str:
        """An instant stat: events in the dashboard's ``$__range``, summed ``by`` (Grafana evaluates an
        instant query at the range's end, so ``time() - $__range_s`` is its start).

        Exact (an integer) for every series Prometheus knew at the range's start, through sidecar restarts
        and scrape gaps shorter than ``LOOKBACK``, and for every engine that started inside the range (its
        first scrape counted in full). Approximate only where Prometheus knows nothing of an engine at the
        range's start and the engine is older than the range (Prometheus restarted without storage): the
        events between the range's start and the first scrape Prometheus has are not counted."""
        return _sum(by, self.counted(metric, selector, "$__range", "(time() - $__range_s)"))


    def count_per_step(self, metric: str, selector: str, by: str) -> str:
        """Per-step bars: events in each step of ``$__interval`` (Grafana's step), summed ``by``.

        Each event is in exactly one step, the first whose end is at or after the scrape that first
        showed it, and the steps of a range add up to ``count_in_range`` over it; integers, no
        extrapolation. Approximate only as ``count_in_range`` is, for the step after a loss of
        Prometheus's storage."""
        return _sum(by, self.counted(metric, selector, "$__interval", "(time() - $__interval_ms / 1000)"))


    def increase_rule(self, metric: str, by: str, window: str = "1h") -> str:
        """A recording rule's expression: events in the last ``window``, summed ``by`` (the name keeps
        Prometheus's ``:increase<window>`` convention; the value is an exact count, not extrapolated).

        Exact as ``count_in_range`` is: a series new in the window counts its first value when its
        engine started in the window; approximate for an engine older than the window that Prometheus
        first saw inside it (restarted without storage)."""
        return _sum(by, self.counted(metric, "", window, f"(time() - {seconds(window)})"))
