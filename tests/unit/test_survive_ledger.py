"""RecomputeLedger: survive mode's counts, and its alarm when recomputes keep happening (kvobs/recompute_ledger.py)."""

from __future__ import annotations

import logging

import pytest

from kvobs.recompute_ledger import ALARM_WINDOW_S, RecomputeLedger


def test_more_recomputes_than_the_limit_within_an_hour_raise_one_alarm(caplog: pytest.LogCaptureFixture) -> None:
    ledger = RecomputeLedger(alarm_per_hour=3)
    with caplog.at_level(logging.ERROR, logger="kvobs"):
        raised = [ledger.recomputed(100, now=60.0 * i) for i in range(8)]
    assert raised == [False, False, False, True, False, False, False, False]  # then quiet for an hour
    assert ledger.counts == {"loads": 8, "tokens": 800, "alarms": 1}
    [line] = [r.getMessage() for r in caplog.records]
    assert "4 loads recomputed within the last hour (more than survive_alarm_per_hour=3)" in line


def test_as_many_as_the_limit_an_hour_raise_nothing() -> None:
    ledger = RecomputeLedger(alarm_per_hour=3)
    spacing = ALARM_WINDOW_S / 3 + 1
    assert not any(ledger.recomputed(1, now=spacing * i) for i in range(30))
    assert ledger.counts["alarms"] == 0


def test_the_alarm_comes_again_an_hour_later_if_they_go_on() -> None:
    ledger = RecomputeLedger(alarm_per_hour=1)
    times = [0.0, 1.0, 2.0, ALARM_WINDOW_S + 1.5, ALARM_WINDOW_S + 2.5]
    # 2.0 and ALARM_WINDOW_S + 1.5 are two within an hour: the alarm again, once the hour of quiet is over.
    assert [ledger.recomputed(1, now=t) for t in times] == [False, True, False, True, False]
