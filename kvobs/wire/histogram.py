"""Bucket counts as the journal's readers aggregate them and failure reports carry them.

Pure: stdlib only (the sidecar imports it).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvobs.codes import BUCKETS
from kvobs.wire.format import MAX_COUNT, MAX_SECONDS, is_count, is_number


@dataclass
class Histogram:
    """Bucket counts (``kvobs.codes.BUCKETS`` and +Inf) and their sum."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    total: float = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, value)] += 1
        self.total += value

    def observe_many(self, values: Sequence[float]) -> None:
        counts = self.counts
        for value in values:
            if value == value:  # NaN: unknown
                counts[bisect.bisect_left(BUCKETS, value)] += 1
                self.total += value

    def add(self, counts: Sequence[int], total: float) -> None:
        self.counts = [have + more for have, more in zip(self.counts, counts, strict=True)]
        self.total += total

    def buckets(self) -> list[tuple[str, int]]:
        """(le, cumulative count) pairs, ending with +Inf."""
        out, running = [], 0
        for bound, count in zip((*BUCKETS, float("inf")), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out

    @classmethod
    def from_json(cls, value: Any) -> Histogram | None:
        """``{"counts": [...], "sum": s}`` as written by :meth:`to_json`, or None if it does not fit."""
        if not isinstance(value, dict):
            return None
        counts, total = value.get("counts"), value.get("sum", value.get("total"))
        if not (isinstance(counts, list) and len(counts) == len(BUCKETS) + 1 and all(is_count(c) for c in counts)
                and is_number(total, 0, MAX_COUNT * MAX_SECONDS)):
            return None
        return cls([int(c) for c in counts], float(total))

    def to_json(self) -> dict[str, Any]:
        return {"counts": list(self.counts), "sum": self.total}

