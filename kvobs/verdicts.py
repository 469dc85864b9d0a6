"""What each request's lookups reported, and which reported chunks are still unpinned.

A lookup that answers HIT or HIT_PENDING promises the connector a chunk it will
pin with ``prepare_load`` soon after. kvobs keeps that promise per request (to
name a failed load's cause) and watches it until the request's load pins it (to
count near misses: promised chunks removed before their load).

A removal only *breaks* a watched promise; it becomes a near miss when the
request's load then asks for that chunk (whether the load succeeds because the
chunk was stored again, or fails). Promises the load does not ask for — the
connector shrank the hit, or the request was scheduled without a load — were
never going to be pinned, and their removal is not counted.

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
    broken: dict[bytes, str] = field(default_factory=dict)  # key -> removal reason
    incomplete: bool = False  # a verdict of this request was dropped (max_entries reached)


class NearMiss(NamedTuple):
    """A promised chunk removed before its request's load asked for it."""

    req_id: str
    key: bytes
    verdict: Verdict
    reason: str


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
                state.incomplete = True
                return
            self._entries += 1
        state.verdicts[key] = verdict
        state.watching = True
        if state.broken:
            state.broken.pop(key, None)  # a fresh promise replaces the broken one
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
        state.broken.pop(key, None)
        self._entries -= 1
        self._unwatch(req_id, key)

    def get(self, req_id: str, key: bytes) -> Verdict | None:
        state = self._requests.get(req_id)
        return None if state is None else state.verdicts.get(key)

    def incomplete(self, req_id: str) -> bool:
        """True if a verdict of this request was dropped: a missing verdict then proves nothing."""
        state = self._requests.get(req_id)
        return state is not None and state.incomplete

    def pinned(self, req_id: str) -> None:
        """The request was scheduled (its load, if any, is prepared): stop watching."""
        state = self._requests.get(req_id)
        if state is None or not state.watching:
            return
        state.watching = False
        state.broken.clear()
        watched = self._watched
        for key in state.verdicts:  # _unwatch, inlined: this runs for every hit of every request
            watchers = watched.get(key)
            if watchers is not None:
                watchers.discard(req_id)
                if not watchers:
                    del watched[key]

    def loaded(self, req_id: str, keys: Iterable[bytes]) -> list[NearMiss]:
        """The request's load asked for ``keys``: the broken promises among them, then stop watching."""
        state = self._requests.get(req_id)
        if state is None:
            return []
        misses: list[NearMiss] = []
        if state.broken:
            broken = state.broken
            misses = [NearMiss(req_id, key, state.verdicts[key], broken[key]) for key in keys if key in broken]
        self.pinned(req_id)
        return misses

    def finished(self, req_id: str) -> None:
        """The request is gone: forget its verdicts."""
        self.pinned(req_id)
        state = self._requests.pop(req_id, None)
        if state is not None:
            self._entries -= len(state.verdicts)

    def removed(self, keys: Iterable[bytes], reason: str) -> int:
        """Keys left the cache: mark (and stop watching) the promises they broke; how many."""
        watched = self._watched
        if not watched:
            return 0
        broken = 0
        requests = self._requests
        for key in keys:
            req_ids = watched.pop(key, None)
            if req_ids is not None:
                for req_id in req_ids:
                    requests[req_id].broken[key] = reason
                    broken += 1
        return broken

    def removed_all(self, reason: str) -> int:
        """Every watched chunk left the cache (a reset that could not list its keys)."""
        return self.removed(list(self._watched), reason)

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
