"""diagnose(): every cause, and the message of DESIGN.md."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from kvobs.diagnosis import CAUSES, MISSING, NOT_READY, KeyFacts, LoadFailure, classify, diagnose
from kvobs.history import Removal
from kvobs.hot_path_loader import Verdict

LOOKUP = Verdict(serial=10, time=100.0, pending=False)
PENDING = Verdict(serial=10, time=100.0, pending=True)


def removal(serial: int, reason: str, t: float = 100.5) -> Removal:
    return Removal(serial=serial, time=t, reason=reason, path="lookup", req_id="req-b")


def broken(serial: int, reason: str, t: float = 100.5) -> dict[str, object]:
    """The facts of a promise that the removal ``serial`` broke."""
    r = removal(serial, reason, t)
    return dict(verdict=LOOKUP, breach=reason, breaking_removal=r, last_removal=r)


def facts(**kw: object) -> KeyFacts:
    base: dict[str, object] = dict(
        key=b"h" * 32 + (5).to_bytes(4, "big"), group=5, end_token=1024, state=MISSING,
        verdict=None, last_removal=None,
    )
    base.update(kw)
    return KeyFacts(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "cause"),
    [
        (broken(12, "capacity"), "evicted_after_lookup"),
        (broken(10, "reset"), "reset_after_lookup"),
        ({**broken(11, "store_failed"), "verdict": PENDING}, "store_failed_after_lookup"),
        (dict(verdict=None, last_removal=removal(12, "capacity")), "coverage_mismatch"),
        (dict(verdict=None), "coverage_mismatch"),
        (dict(verdict=None, verdicts_dropped=True), "unknown"),
        (dict(state=NOT_READY, verdict=PENDING), "store_in_flight"),
        (dict(verdict=LOOKUP), "unknown"),
        (dict(verdict=LOOKUP, last_removal=removal(9, "capacity")), "unknown"),  # removed before the promise
        ({**broken(12, "capacity"), "breaking_removal": None}, "evicted_after_lookup"),  # details aged out
        # the promise was broken by a capacity eviction; a later failed store of the re-stored key is not the cause
        ({**broken(12, "capacity"), "last_removal": removal(20, "store_failed", 101.0)}, "evicted_after_lookup"),
    ],
)
def test_classify(kw: dict[str, object], cause: str) -> None:
    assert cause in CAUSES
    assert classify(facts(**kw)) == cause


def failure(missing: list[KeyFacts], num_keys: int = 1) -> LoadFailure:
    return LoadFailure(
        vllm_message="Chunk b'hh' not found in cache", req_id="req-a", num_keys=num_keys,
        end_token_range=(1024, 1024), missing=missing, history_keys=1, history_window_s=0.0, now=100.5,
    )


def test_message_follows_the_contract() -> None:
    d = diagnose(failure([facts(**broken(12, "capacity", t=100.5))]))
    assert d.cause == "evicted_after_lookup"
    assert d.message.startswith(
        "Chunk b'hh' not found in cache (group=5, req_id='req-a'). 1 of 1 keys in this load are missing. "
        "(end_token, seconds since eviction) per missing key: [(1024, 0.0)]; load end_token range: 1024-1024; "
        "eviction history: 1 keys over 0.0s. cause: evicted_after_lookup ("
    )
    assert "0.5s after the lookup" in d.message and "path=lookup" in d.message and "'req-b'" in d.message


def test_at_most_sixteen_keys_are_listed_and_none_for_no_removal() -> None:
    missing = [facts(end_token=i * 16) for i in range(20)]
    d = diagnose(failure(missing, num_keys=40))
    listed = re.search(r"per missing key: (\[.*?\])", d.message)
    assert listed is not None
    assert listed.group(1).count("(") == 16 and "(0, None)" in listed.group(1)
    assert "(+4 more)" in d.message and "20 of 40 keys" in d.message


def test_first_keys_cause_is_the_loads_and_others_are_counted() -> None:
    d = diagnose(failure([facts(), facts(**broken(12, "capacity"))], num_keys=2))
    assert d.cause == "coverage_mismatch"
    assert d.causes == {"coverage_mismatch": 1, "evicted_after_lookup": 1}
    assert "causes per key: coverage_mismatch=1, evicted_after_lookup=1" in d.message


def test_the_breaking_removal_is_the_cause_and_a_later_one_is_mentioned() -> None:
    later = Removal(serial=20, time=100.4, reason="store_failed", path="complete_store", req_id="req-c")
    d = diagnose(failure([facts(**{**broken(12, "capacity", t=100.2), "last_removal": later})]))
    assert d.cause == "evicted_after_lookup"
    evidence = d.keys[0].evidence
    assert "capacity removal 0.2s after the lookup, path=lookup, req_id='req-b'" in evidence
    assert "removed again since: store_failed 0.1s ago, path=complete_store, req_id='req-c'" in evidence
    assert d.keys[0].age_s == 0.1  # seconds since the key's last removal, as DESIGN.md's message says


def test_a_breach_whose_details_aged_out_still_names_its_reason() -> None:
    d = diagnose(failure([facts(**{**broken(12, "reset"), "breaking_removal": None, "last_removal": None})]))
    assert d.cause == "reset_after_lookup"
    assert "reset removal after the lookup (its details are older than the history)" in d.keys[0].evidence


def test_the_message_is_written_byte_for_byte_as_before() -> None:
    """The whole text, as kvobs 0.1.0 wrote it (checks outside the tests read it): one key; twenty keys
    (sixteen listed, an unknown range, quotes in the request id, several causes, evidence holding ``); ``);
    no key identified. ``kvobs.message`` defines it now; these texts must not move."""
    later = Removal(serial=20, time=100.4, reason="store_failed", path="complete_store", req_id="req-c")
    one = diagnose(failure([facts(**broken(12, "capacity"))]))
    assert one.message == (
        "Chunk b'hh' not found in cache (group=5, req_id='req-a'). 1 of 1 keys in this load are missing. "
        "(end_token, seconds since eviction) per missing key: [(1024, 0.0)]; load end_token range: 1024-1024; "
        "eviction history: 1 keys over 0.0s. cause: evicted_after_lookup (lookup reported HIT 0.5s before the load; "
        "capacity removal 0.5s after the lookup, path=lookup, req_id='req-b')"
    )
    first = facts(end_token=2000, verdict=LOOKUP, breach="reset", breaking_removal=None, last_removal=later)
    others = [facts(end_token=i * 16, last_removal=removal(3, "capacity", 99.0) if i % 2 else None) for i in range(19)]
    many = diagnose(replace(failure([first, *others], num_keys=40), end_token_range=None, history_keys=123456,
                            history_window_s=3599.96, req_id='it\'s "quoted"', failing_group=2))
    assert many.message == (
        "Chunk b'hh' not found in cache (group=2, req_id='it\\'s \"quoted\"'). 20 of 40 keys in this load are "
        "missing. (end_token, seconds since eviction) per missing key: [(2000, 0.1), (0, None), (16, 1.5), "
        "(32, None), (48, 1.5), (64, None), (80, 1.5), (96, None), (112, 1.5), (128, None), (144, 1.5), (160, None), "
        "(176, 1.5), (192, None), (208, 1.5), (224, None)] (+4 more); load end_token range: unknown; eviction "
        "history: 123456 keys over 3600.0s. cause: reset_after_lookup (lookup reported HIT 0.5s before the load; "
        "reset removal after the lookup (its details are older than the history); removed again since: "
        "store_failed 0.1s ago, path=complete_store, req_id='req-c'); causes per key: coverage_mismatch=19, "
        "reset_after_lookup=1"
    )
    none = diagnose(failure([], num_keys=3))
    assert none.message == (
        "Chunk b'hh' not found in cache (group=None, req_id='req-a'). 0 of 3 keys in this load are missing. "
        "(end_token, seconds since eviction) per missing key: []; load end_token range: 1024-1024; "
        "eviction history: 1 keys over 0.0s. cause: unknown (no missing key was identified)"
    )
