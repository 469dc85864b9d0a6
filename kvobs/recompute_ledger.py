"""What survive mode counts: recomputed loads and tokens, and the alarm when they keep happening.

Pure logic (no vLLM): the glue in ``kvobs/vllm/survive.py`` reports each load it turned into a
recompute; its counts are the observer's ``counts["survive"]`` (kvobs/metric_catalogue.py: the
journal's totals carry them, the sidecar exports them as ``kvobs_recomputed_loads_total``,
``kvobs_recomputed_tokens_total`` and ``kvobs_recompute_alarms_total``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque

logger = logging.getLogger("kvobs")

ALARM_WINDOW_S = 3600.0


class RecomputeLedger:
    """Counts recomputes; raises the alarm (an ERROR line and a counted alarm) when more than
    ``alarm_per_hour`` happen within an hour, at most once an hour. Memory: ``alarm_per_hour + 1``
    timestamps."""

    def __init__(self, alarm_per_hour: int, counts: Counter[str] | None = None) -> None:
        self.alarm_per_hour = alarm_per_hour
        self.counts: Counter[str] = Counter() if counts is None else counts
        """``loads``, ``tokens`` and ``alarms`` (the observer passes its ``counts["survive"]``)."""
        self._recent: deque[float] = deque(maxlen=alarm_per_hour + 1)
        self._quiet_until = float("-inf")

    def recomputed(self, tokens: int, now: float | None = None) -> bool:
        """Count one recomputed load of ``tokens`` tokens; whether it raised the alarm."""
        now = time.monotonic() if now is None else now
        self.counts["loads"] += 1
        self.counts["tokens"] += tokens
        self._recent.append(now)
        full = len(self._recent) > self.alarm_per_hour
        if not full or now - self._recent[0] > ALARM_WINDOW_S or now < self._quiet_until:
            return False
        self.counts["alarms"] += 1
        self._quiet_until = now + ALARM_WINDOW_S
        logger.error(
            "kvobs survive: %d loads recomputed within the last hour (more than survive_alarm_per_hour=%d): "
            "the offload tier keeps losing chunks requests were promised; each costs a recompute. "
            "See the causes (kvobs_load_failures_total, the failure reports) and docs/runbook.md",
            len(self._recent), self.alarm_per_hour,
        )
        return True
