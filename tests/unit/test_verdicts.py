"""LookupVerdicts: promises per request, near misses, bounds."""

from __future__ import annotations

from kvobs.verdicts import LookupVerdicts, Verdict

V = Verdict(serial=3, time=1.0, pending=False)


def test_removed_promise_is_a_near_miss_once() -> None:
    verdicts = LookupVerdicts()
    verdicts.reported("a", b"k1", V)
    verdicts.reported("a", b"k2", V)
    misses = verdicts.removed([b"k1", b"zz"])
    assert [(m.req_id, m.key) for m in misses] == [("a", b"k1")]
    assert verdicts.removed([b"k1"]) == []  # counted once
    assert verdicts.get("a", b"k1") == V  # the verdict itself is kept for diagnosis


def test_pinned_request_is_no_longer_watched() -> None:
    verdicts = LookupVerdicts()
    verdicts.reported("a", b"k", V)
    verdicts.pinned("a")
    assert verdicts.removed([b"k"]) == []
    assert verdicts.get("a", b"k") == V


def test_two_requests_promised_the_same_chunk() -> None:
    verdicts = LookupVerdicts()
    verdicts.reported("a", b"k", V)
    verdicts.reported("b", b"k", V)
    verdicts.pinned("a")
    assert [m.req_id for m in verdicts.removed([b"k"])] == ["b"]


def test_a_later_miss_voids_the_promise() -> None:
    verdicts = LookupVerdicts()
    verdicts.reported("a", b"k", V)
    verdicts.not_reported("a", b"k")
    assert verdicts.get("a", b"k") is None
    assert verdicts.removed([b"k"]) == [] and len(verdicts) == 0


def test_finished_request_is_forgotten() -> None:
    verdicts = LookupVerdicts()
    verdicts.reported("a", b"k", V)
    verdicts.finished("a")
    assert verdicts.get("a", b"k") is None and len(verdicts) == 0 and verdicts.watched_keys == 0


def test_bounded_entries_drop_and_count() -> None:
    verdicts = LookupVerdicts(max_entries=2)
    for key in (b"1", b"2", b"3", b"4"):
        verdicts.reported("a", key, V)
    assert len(verdicts) == 2 and verdicts.dropped == 2
    verdicts.reported("a", b"1", V)  # refreshing a kept verdict is not a new entry
    assert verdicts.dropped == 2


def test_removed_all_breaks_every_watched_promise() -> None:
    verdicts = LookupVerdicts()
    verdicts.reported("a", b"k1", V)
    verdicts.reported("b", b"k2", V)
    assert sorted(m.req_id for m in verdicts.removed_all()) == ["a", "b"]
    assert verdicts.watched_keys == 0
