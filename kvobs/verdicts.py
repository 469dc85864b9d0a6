"""What each request's lookups reported, and which reported chunks are still unpinned.

A lookup that answers HIT or HIT_PENDING promises the connector a chunk it will
pin with ``prepare_load`` soon after. kvobs keeps that promise per request (to
name a failed load's cause) and watches it until the request's load pins it (to
count near misses: promised chunks removed before their load).

Bounded: at most ``max_entries`` verdicts across all requests; a verdict that
does not fit is dropped and counted, never an error.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple


class Verdict(NamedTuple):
    """One positive lookup answer: when it was given, and whether it was pending."""

    serial: int
    time: float
    pending: bool


@dataclass(slots=True)
class _RequestVerdicts:
    verdicts: dict[bytes, Verdict] = field(default_factory=dict)
    watching: bool = True


class NearMiss(NamedTuple):
    """A promised chunk removed before its request's load pinned it."""

    req_id: str
    key: bytes
    verdict: Verdict


class LookupVerdicts:
    """Per-request positive lookup verdicts, plus the near-miss watch over them."""

    def __init__(self, max_entries: int = 262_144) -> None:
        self.max_entries = max_entries
        self._requests: dict[str, _RequestVerdicts] = {}
        self._watched: dict[bytes, set[str]] = {}
        self._entries = 0
        self.dropped = 0

    def __len__(self) -> int:
        return self._entries

    @property
    def watched_keys(self) -> int:
        return len(self._watched)

    def reported(self, req_id: str, key: bytes, verdict: Verdict) -> None:
        """A lookup by ``req_id`` answered HIT / HIT_PENDING for ``key``."""
        state = self._requests.get(req_id)
        if state is None:
            state = self._requests[req_id] = _RequestVerdicts()
        if key not in state.verdicts:
            if self._entries >= self.max_entries:
                self.dropped += 1
                return
            self._entries += 1
        state.verdicts[key] = verdict
        state.watching = True
        watchers = self._watched.get(key)
        if watchers is None:
            self._watched[key] = {req_id}
        else:
            watchers.add(req_id)

    def not_reported(self, req_id: str, key: bytes) -> None:
        """A later lookup by ``req_id`` answered MISS/RETRY: the old promise is void."""
        state = self._requests.get(req_id)
        if state is None or state.verdicts.pop(key, None) is None:
            return
        self._entries -= 1
        self._unwatch(req_id, key)

    def get(self, req_id: str, key: bytes) -> Verdict | None:
        state = self._requests.get(req_id)
        return None if state is None else state.verdicts.get(key)

    def pinned(self, req_id: str) -> None:
        """The request's load was prepared: its promises are kept, stop watching."""
        state = self._requests.get(req_id)
        if state is None or not state.watching:
            return
        state.watching = False
        for key in state.verdicts:
            self._unwatch(req_id, key)

    def finished(self, req_id: str) -> None:
        """The request is gone: forget its verdicts."""
        self.pinned(req_id)
        state = self._requests.pop(req_id, None)
        if state is not None:
            self._entries -= len(state.verdicts)

    def removed(self, keys: Iterable[bytes]) -> list[NearMiss]:
        """Keys left the cache: return (and stop watching) the promises they broke."""
        watched = self._watched
        if not watched:
            return []
        hits = [key for key in keys if key in watched]
        misses: list[NearMiss] = []
        for key in hits:
            for req_id in watched.pop(key):
                verdict = self._requests[req_id].verdicts[key]
                misses.append(NearMiss(req_id, key, verdict))
        return misses

    def removed_all(self) -> list[NearMiss]:
        """Every watched chunk left the cache (a reset that could not list its keys)."""
        return self.removed(list(self._watched))

    def clear(self) -> None:
        self._requests.clear()
        self._watched.clear()
        self._entries = 0

    def _unwatch(self, req_id: str, key: bytes) -> None:
        watchers = self._watched.get(key)
        if watchers is None:
            return
        watchers.discard(req_id)
        if not watchers:
            del self._watched[key]
