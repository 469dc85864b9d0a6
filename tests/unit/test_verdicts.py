"""LookupVerdicts: promises per request, near misses, bounds (the Python reference and its C twin)."""

from __future__ import annotations

from typing import Any

import pytest

from kvobs.recorder import speedups_module
from kvobs.verdicts import LookupVerdicts, Verdict

IMPLEMENTATIONS = [pytest.param(LookupVerdicts, id="python")]
if speedups_module() is not None:
    IMPLEMENTATIONS.append(pytest.param(speedups_module().Verdicts, id="c"))


@pytest.fixture(params=IMPLEMENTATIONS)
def make(request: pytest.FixtureRequest) -> Any:
    return request.param

V = Verdict(serial=3, time=1.0, pending=False)


def test_removed_promise_is_a_near_miss_once_its_load_asks_for_it(make: Any) -> None:
    verdicts = make()
    verdicts.reported("a", b"k1", V)
    verdicts.reported("a", b"k2", V)
    assert verdicts.removed([b"k1", b"zz"], "capacity") == 1
    assert verdicts.removed([b"k1"], "capacity") == 0  # broken once
    assert verdicts.get("a", b"k1") == V  # the verdict itself is kept for diagnosis
    misses = verdicts.loaded("a", [b"k1", b"k2"])
    assert [(m.req_id, m.key, m.reason) for m in misses] == [("a", b"k1", "capacity")]
    assert verdicts.loaded("a", [b"k1"]) == []  # counted once


def test_broken_promise_the_load_does_not_ask_for_is_not_a_near_miss(make: Any) -> None:
    verdicts = make()
    verdicts.reported("a", b"fa", V)
    verdicts.reported("a", b"sw", V)
    assert verdicts.removed([b"fa"], "capacity") == 1
    assert verdicts.loaded("a", [b"sw"]) == []  # the connector shrank the hit: fa was never loaded


def test_scheduled_without_a_load_forgets_broken_promises(make: Any) -> None:
    verdicts = make()
    verdicts.reported("a", b"k", V)
    verdicts.removed([b"k"], "capacity")
    verdicts.pinned("a")
    assert verdicts.loaded("a", [b"k"]) == []


def test_pinned_request_is_no_longer_watched(make: Any) -> None:
    verdicts = make()
    verdicts.reported("a", b"k", V)
    verdicts.pinned("a")
    assert verdicts.removed([b"k"], "capacity") == 0
    assert verdicts.get("a", b"k") == V


def test_two_requests_promised_the_same_chunk(make: Any) -> None:
    verdicts = make()
    verdicts.reported("a", b"k", V)
    verdicts.reported("b", b"k", V)
    verdicts.pinned("a")
    assert verdicts.removed([b"k"], "capacity") == 1
    assert [m.req_id for m in verdicts.loaded("b", [b"k"])] == ["b"]


def test_a_later_miss_voids_the_promise(make: Any) -> None:
    verdicts = make()
    verdicts.reported("a", b"k", V)
    verdicts.not_reported("a", b"k")
    assert verdicts.get("a", b"k") is None
    assert verdicts.removed([b"k"], "capacity") == 0 and len(verdicts) == 0


def test_finished_request_is_forgotten(make: Any) -> None:
    verdicts = make()
    verdicts.reported("a", b"k", V)
    verdicts.finished("a")
    assert verdicts.get("a", b"k") is None and len(verdicts) == 0 and verdicts.watched_keys == 0


def test_bounded_entries_drop_and_count(make: Any) -> None:
    verdicts = make(max_entries=2)
    for key in (b"1", b"2", b"3", b"4"):
        verdicts.reported("a", key, V)
    assert len(verdicts) == 2 and verdicts.dropped == 2
    verdicts.reported("a", b"1", V)  # refreshing a kept verdict is not a new entry
    assert verdicts.dropped == 2


def test_removed_all_breaks_every_watched_promise(make: Any) -> None:
    verdicts = make()
    verdicts.reported("a", b"k1", V)
    verdicts.reported("b", b"k2", V)
    assert verdicts.removed_all("reset") == 2
    assert verdicts.watched_keys == 0
    assert [m.reason for m in verdicts.loaded("b", [b"k2"])] == ["reset"]


def test_a_fresh_hit_after_the_removal_replaces_the_broken_promise(make: Any) -> None:
    verdicts = make()
    verdicts.reported("a", b"k", V)
    verdicts.removed([b"k"], "capacity")
    verdicts.reported("a", b"k", V)  # the request looked again (e.g. deferred) and got a hit
    assert verdicts.loaded("a", [b"k"]) == []
