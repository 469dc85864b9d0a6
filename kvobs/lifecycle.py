"""Requests' offload lifecycle as kvobs's connector saw it, and its recent calls: bounded, in memory.

Why: an exception at the connector's boundary (kvobs/vllm/boundary.py) kills the engine, and what led
there is the requests' story through the connector: arrival, lookups, allocations, store and load
jobs, abort, finish. Nothing else in kvobs records the connector's calls (the manager's taps see the
manager's). Pure (no vLLM): the glue hands it plain events. Bounded: ``RECENT`` events in all,
``PER_REQUEST`` per request for at most ``REQUESTS`` requests (the oldest forgotten first, counted).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from typing import Any, NamedTuple

RECENT = 256
"""Calls the connector keeps (the report's ``events``)."""
REQUESTS = 4_096
"""Requests whose lifecycle is kept; a finished request is forgotten ``KEEP_FINISHED`` finishes later."""
PER_REQUEST = 32
"""Events kept per request: the first ``PER_REQUEST // 2`` (arrival, first lookups) and the latest."""
KEEP_FINISHED = 256
"""Finished requests kept (an exception right after a finish names it: vLLM #49118's abort)."""
NOT_RECORDED = (
    "calls to vLLM's scheduler-side connector made before kvobs's connector was built",
    "what vLLM's scheduler decided between connector calls (preemptions, its own queue)",
    "the manager's calls per request beyond its lookup verdicts (the flight recorder keeps them, opt-in)",
    "worker-side transfers (their results reach the scheduler side through update_connector_output)",
)
"""What a report says the lifecycle does not hold."""


class Event(NamedTuple):
    time: float
    """Wall time (seconds since the epoch)."""
    method: str
    """The connector's method (``on_new_request``, ``get_num_new_matched_tokens``, ...)."""
    req_id: str | None
    detail: str
    """What the call said, short: its result, tokens, jobs, the request's status."""

    def to_json(self) -> dict[str, Any]:
        return {"time": round(self.time, 6), "method": self.method, "req_id": self.req_id, "detail": self.detail}


class Lifecycle:
    """The recent events and each request's events; appended on vLLM's scheduler thread (O(1))."""

    def __init__(self) -> None:
        self.recent: deque[Event] = deque(maxlen=RECENT)
        self.requests: OrderedDict[str, tuple[list[Event], deque[Event], list[int]]] = OrderedDict()
        self.finished: deque[str] = deque()
        self.forgotten = 0
        """Requests dropped to stay bounded (a report says when its request is among them)."""

    def note(self, method: str, req_id: str | None, detail: str = "") -> None:
        event = Event(time.time(), method, req_id, detail[:200])
        self.recent.append(event)
        if req_id is None:
            return
        kept = self.requests.get(req_id)
        if kept is None:
            if len(self.requests) >= REQUESTS:
                self.requests.popitem(last=False)
                self.forgotten += 1
            kept = ([], deque(maxlen=PER_REQUEST - PER_REQUEST // 2), [0])
            self.requests[req_id] = kept
        first, latest, seen = kept
        seen[0] += 1
        (first if len(first) < PER_REQUEST // 2 else latest).append(event)

    def finish(self, req_id: str) -> None:
        """The request finished: kept for ``KEEP_FINISHED`` more finishes."""
        self.finished.append(req_id)
        while len(self.finished) > KEEP_FINISHED:
            self.requests.pop(self.finished.popleft(), None)

    def of(self, req_id: str) -> dict[str, Any]:
        """One request's lifecycle as a report carries it."""
        kept = self.requests.get(req_id)
        if kept is None:
            return {"req_id": req_id, "recorded": False, "events": []}
        first, latest, seen = kept
        events = [*first, *latest]
        return {"req_id": req_id, "recorded": True, "events": [e.to_json() for e in events],
                "events_not_kept": seen[0] - len(events)}

    def recent_json(self, limit: int = 64) -> list[dict[str, Any]]:
        return [e.to_json() for e in list(self.recent)[-limit:]]
