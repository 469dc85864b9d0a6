"""Promises: the one rule the near-miss counter and the diagnosis share (kvobs/hot_promises.py).

A lookup's HIT makes a promise; a removal of its key after it breaks it; a load asking for a
broken promise is a near miss (once, until the key is removed again), counted under the reason
of the first removal after the promise, which is also a missing key's cause. The property
test checks the recorder and the observer against the rule written out as plainly as
possible: a log of every event, searched from scratch.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings, strategies as st

from kvobs.codes import REASONS
from kvobs.hot_path_loader import Promises, RecentRemovals
from kvobs.observer import Observer
from kvobs.options import Options

ROW = (3 << 1, 1.0)  # (serial << 1 | pending, time)


def _broken(p: Promises, recent: RecentRemovals, req: str, keys: list[bytes], now: int) -> list[bytes]:
    return [key for key, _, decided in p.redeemed(req, keys, recent, now) if decided]


def test_a_removed_promise_is_a_near_miss_once_its_load_asks_for_it() -> None:
    p, recent = Promises(100), RecentRemovals(100)
    p.reported("a", b"k1", *ROW)
    p.reported("a", b"k2", *ROW)
    recent.add([b"k1", b"zz"], 7)
    assert _broken(p, recent, "a", [b"k1", b"k2"], 8) == [b"k1"]
    assert _broken(p, recent, "a", [b"k1"], 8) == []  # counted once
    recent.add([b"k1"], 9)  # removed again after that load: the next load counts it again
    assert _broken(p, recent, "a", [b"k1"], 10) == [b"k1"]
    assert p.verdict("a", b"k1") is not None  # the promise itself is kept for the diagnosis


def test_a_removal_before_the_promise_is_not_a_near_miss() -> None:
    p, recent = Promises(100), RecentRemovals(100)
    recent.add([b"k"], 2)
    p.reported("a", b"k", *ROW)  # made at serial 3: after that removal (the chunk was stored again)
    assert _broken(p, recent, "a", [b"k"], 4) == []


def test_a_broken_promise_the_load_does_not_ask_for_is_not_a_near_miss() -> None:
    p, recent = Promises(100), RecentRemovals(100)
    p.reported("a", b"fa", *ROW)
    p.reported("a", b"sw", *ROW)
    recent.add([b"fa"], 4)
    assert _broken(p, recent, "a", [b"sw"], 5) == []  # the connector shrank the hit: fa was never loaded


def test_a_later_miss_voids_the_promise_and_a_finished_request_is_forgotten() -> None:
    p, recent = Promises(100), RecentRemovals(100)
    p.reported("a", b"k", *ROW)
    p.not_reported("a", b"k")
    assert p.verdict("a", b"k") is None and len(p) == 0
    recent.add([b"k"], 4)
    assert _broken(p, recent, "a", [b"k"], 5) == []
    p.reported("b", b"k", *ROW)
    p.finished("b")
    assert p.verdict("b", b"k") is None and len(p) == 0


def test_bounded_entries_are_dropped_counted_and_mark_the_request_incomplete() -> None:
    p = Promises(2)
    for req, key in (("a", b"1"), ("a", b"2"), ("a", b"3"), ("b", b"1")):
        p.reported(req, key, *ROW)
    assert len(p) == 2 and p.dropped == 2
    assert p.incomplete("a") and p.incomplete("b")  # a missing promise of theirs proves nothing
    p.finished("a")
    p.finished("b")
    assert len(p) == 0 and not p.incomplete("a")


def test_a_reset_that_listed_no_keys_breaks_every_earlier_promise() -> None:
    p, recent = Promises(100), RecentRemovals(100)
    p.reported("a", b"1", *ROW)
    recent.unlisted_reset = 5
    assert _broken(p, recent, "a", [b"1"], 6) == [b"1"]


def test_recent_removals_are_bounded_and_keep_at_least_one_generation() -> None:
    recent = RecentRemovals(1_000)
    for serial in range(10_000):
        recent.add([serial.to_bytes(8, "big")], serial)
    assert len(recent) <= 2_000
    assert recent.last((9_000).to_bytes(8, "big")) == 9_000
    assert recent.last((10).to_bytes(8, "big")) == -1


# -- the rule, written out as plainly as possible, against random operations -------------------

REQS = ["a", "b", "c"]
KEYS = [bytes([i]) * 36 for i in range(5)]

operations = st.lists(
    st.one_of(
        st.tuples(st.just("hit"), st.sampled_from(REQS), st.sampled_from(KEYS)),
        st.tuples(st.just("miss"), st.sampled_from(REQS), st.sampled_from(KEYS)),
        st.tuples(st.just("remove"), st.lists(st.sampled_from(KEYS), max_size=3), st.integers(0, 2)),
        st.tuples(st.just("load"), st.sampled_from(REQS), st.lists(st.sampled_from(KEYS), max_size=3, unique=True)),
        st.tuples(st.just("finish"), st.sampled_from(REQS)),
    ),
    max_size=60,
)


class Rule:
    """The module docstring's rule over a log of everything that happened, searched from scratch."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []

    def promise(self, req: str, key: bytes) -> int | None:
        """Log index of the hit that made the live promise of (req, key), if any."""
        made = None
        for i, event in enumerate(self.log):
            if event[0] == "hit" and event[1:] == (req, key):
                made = i
            elif (event[0] == "miss" and event[1:] == (req, key)) or (event[0] == "finish" and event[1] == req):
                made = None
        return made

    def removals_after(self, key: bytes, index: int) -> list[int]:
        return [i for i in range(index + 1, len(self.log)) if self.log[i][0] == "remove" and key in self.log[i][1]]

    def near_misses(self, req: str, keys: list[bytes]) -> list[tuple[bytes, str]]:
        """(key, reason of the first removal after the promise) for each near miss of this load."""
        out = []
        for key in keys:
            made = self.promise(req, key)
            if made is None:
                continue
            after = self.removals_after(key, made)
            counted = [i for i in range(made, len(self.log))
                       if self.log[i][0] == "counted" and self.log[i][1:] == (req, key)]
            if after and (not counted or after[-1] > counted[-1]):
                out.append((key, REASONS[self.log[after[0]][2]]))
        for key, _ in out:
            self.log.append(("counted", req, key))
        return out


@settings(max_examples=300, deadline=None)
@given(ops=operations)
def test_the_recorder_and_the_observer_follow_the_rule(ops: list[tuple[Any, ...]]) -> None:
    observer = Observer(Options(history_size=4096))
    promises, recorder, rule = observer.promises, observer.recorder, Rule()
    for op in ops:
        name = op[0]
        if name == "hit":
            promises.reported(op[1], op[2], recorder.next_serial << 1, 0.0)
        elif name == "miss":
            promises.not_reported(op[1], op[2])
        elif name == "remove":
            recorder.removal(list(op[1]), op[2], None, 0.0, path=0, req_id=None)
            observer.drain()  # the captured removal, applied
        elif name == "finish":
            promises.finished(op[1])
        if name != "load":
            rule.log.append(op)
            continue
        broken = promises.redeemed(op[1], op[2], recorder.recent, recorder.next_serial)
        near = observer.near_missed(op[1], broken)
        got = [(m.key, None if m.breach is None else REASONS[m.breach.reason]) for m in near]
        assert got == rule.near_misses(op[1], op[2]), op
    assert len(promises) == sum(rule.promise(r, k) is not None for r in REQS for k in KEYS)
    assert sum(observer.near_misses.values()) == sum(1 for e in rule.log if e[0] == "counted")


def test_promises_older_than_the_short_memory_are_left_to_the_history() -> None:
    """RecentRemovals answers exactly only back to ``exact_from``; an older promise is handed on
    undecided (the observer asks the history), never taken for "not removed"."""
    p, recent = Promises(100), RecentRemovals(2)
    p.reported("a", b"k", 0 << 1, 0.0)  # promised before any removal
    recent.add([b"k"], 0)
    recent.add([b"x"], 1)  # generation full: rotates; k still remembered
    assert recent.exact_from == 0
    recent.add([b"y", b"z"], 2)  # rotates again: k's removal (serial 0) is forgotten
    assert recent.exact_from == 2 and recent.last(b"k") == -1
    assert p.redeemed("a", [b"k"], recent, 3) == [(b"k", p.verdict("a", b"k"), False)]
    assert p.settle("a", b"k", 0, 3) and not p.settle("a", b"k", 0, 3)  # counted once
    p.reported("b", b"y", 2 << 1, 0.0)  # a promise the memory reaches: decided here
    recent.add([b"y"], 3)
    assert p.redeemed("b", [b"y"], recent, 4) == [(b"y", p.verdict("b", b"y"), True)]
