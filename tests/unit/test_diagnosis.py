"""diagnose(): every cause, and the message of DESIGN.md."""

from __future__ import annotations

import re

import pytest

from kvobs.diagnosis import CAUSES, MISSING, NOT_READY, KeyFacts, LoadFailure, classify, diagnose
from kvobs.history import Removal
from kvobs.verdicts import Verdict

LOOKUP = Verdict(serial=10, time=100.0, pending=False)
PENDING = Verdict(serial=10, time=100.0, pending=True)


def removal(serial: int, reason: str, t: float = 100.5) -> Removal:
    return Removal(serial=serial, time=t, reason=reason, path="lookup", req_id="req-b")


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
        (dict(verdict=LOOKUP, last_removal=removal(12, "capacity")), "evicted_after_lookup"),
        (dict(verdict=LOOKUP, last_removal=removal(10, "reset")), "reset_after_lookup"),
        (dict(verdict=PENDING, last_removal=removal(11, "store_failed")), "store_failed_after_lookup"),
        (dict(verdict=None, last_removal=removal(12, "capacity")), "coverage_mismatch"),
        (dict(verdict=None), "coverage_mismatch"),
        (dict(state=NOT_READY, verdict=PENDING), "store_in_flight"),
        (dict(verdict=LOOKUP), "unknown"),
        (dict(verdict=LOOKUP, last_removal=removal(9, "capacity")), "unknown"),  # removed before lookup
        (dict(verdict=LOOKUP, reset_after_lookup=removal(11, "reset")), "reset_after_lookup"),
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
    d = diagnose(failure([facts(verdict=LOOKUP, last_removal=removal(12, "capacity", t=100.5))]))
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
    d = diagnose(failure([facts(), facts(verdict=LOOKUP, last_removal=removal(12, "capacity"))], num_keys=2))
    assert d.cause == "coverage_mismatch"
    assert d.causes == {"coverage_mismatch": 1, "evicted_after_lookup": 1}
    assert "causes per key: coverage_mismatch=1, evicted_after_lookup=1" in d.message
