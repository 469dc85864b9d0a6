"""Requests' offload lifecycle as kvobs's connector saw it, and its recent calls: bounded, in memory.

Why: an exception at the connector's boundary (kvobs/vllm/boundary.py) kills the engine, and what led
there is the requests' story through the connector: arrival, lookups, allocations, store and load
jobs, abort, finish. Nothing else in kvobs records the connector's calls (the manager's taps see the
manager's). Pure (no vLLM): the glue hands it raw values. Bounded and cheap on vLLM's scheduler thread:
one ring of ``RECENT`` events, a tuple each, no text made and no index kept per call (an index and the
text cost 1.5 us a guarded call, several a scheduler step); a request's story is read out of the ring
when a report is made. A request whose arrival left the ring says when the ring starts.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

RECENT = 4_096
"""Connector calls the ring keeps: a few scheduler steps' worth at hundreds of requests, minutes when idle."""
PER_REQUEST = 32
"""Events a report details per request: the first ``PER_REQUEST // 2`` in the ring and the latest."""
NOT_RECORDED = (
    "calls to vLLM's scheduler-side connector made before kvobs's connector was built",
    "what vLLM's scheduler decided between connector calls (preemptions, its own queue)",
    "the manager's calls per request beyond its lookup verdicts (the flight recorder keeps them: a replay bundle)",
    "worker-side transfers (their results reach the scheduler side through update_connector_output)",
)
"""What a report says the lifecycle does not hold."""


Event = tuple[float, str, "str | None", tuple[Any, ...]]
"""(wall time, the connector's method, the request id, what the call said as ``(name, value, ...)``): kept raw
and rendered only when a report is made (:func:`event_json`), so a guarded call costs a tuple and no text."""


def event_json(event: Event) -> dict[str, Any]:
    """One event as a report carries it: ``detail`` is ``name=value`` pairs, an enum by its name, at most 200
    characters."""
    when, method, req_id, said = event
    parts = []
    for i in range(0, len(said) - 1, 2):
        value = said[i + 1]
        parts.append(f"{said[i]}={getattr(value, 'name', None) or value!r}")
    return {"time": round(when, 6), "method": method, "req_id": req_id, "detail": " ".join(parts)[:200]}


class Lifecycle:
    """The connector's recent events, one ring: appended on vLLM's scheduler thread (one tuple, no text, no
    index); a request's story is read out of the ring when a report is made, which is rare."""

    def __init__(self) -> None:
        self.recent: deque[Event] = deque(maxlen=RECENT)

    def note(self, method: str, req_id: str | None, *said: Any) -> None:
        """The call ``method`` of ``req_id`` returned; ``said``: ``name, value, ...`` (scalars, enums, vLLM's small
        results)."""
        self.recent.append((time.time(), method, req_id, said))

    def of(self, req_id: str) -> dict[str, Any]:
        """One request's lifecycle as a report carries it: its events still in the ring, the first
        ``PER_REQUEST // 2`` and the latest."""
        events = [e for e in self.recent if e[2] == req_id]
        if not events:
            return {"req_id": req_id, "recorded": False, "events": []}
        kept = events if len(events) <= PER_REQUEST else [*events[:PER_REQUEST // 2], *events[-PER_REQUEST // 2:]]
        return {"req_id": req_id, "recorded": True, "events": [event_json(e) for e in kept],
                "events_not_kept": len(events) - len(kept),
                "ring_starts": None if len(self.recent) < RECENT else round(self.recent[0][0], 6)}

    def recent_json(self, limit: int = 64) -> list[dict[str, Any]]:
        return [event_json(e) for e in list(self.recent)[-limit:]]
