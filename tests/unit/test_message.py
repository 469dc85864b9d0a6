"""kvobs.message: the failure message written from its parts is read back by `kvobs explain`, field for field."""

from __future__ import annotations

import io
import subprocess
import sys
from typing import Any

from hypothesis import given, settings, strategies as st

from kvobs import explain, message
from kvobs.codes import CAUSES
from kvobs.diagnosis import MISSING, NOT_READY, KeyFacts, LoadFailure, diagnose
from kvobs.history import Removal
from kvobs.hot_path_loader import Verdict
from kvobs.wire.format import MAX_GROUP

KEY = b"\x07" * 32 + (3).to_bytes(4, "big")
VLLM = f"Chunk {KEY!r} not found in cache"
PREFIX = "(EngineCore_DP0 pid=7) ERROR 11-29 10:00:00 [core.py:1] AssertionError: "
SETTINGS = settings(max_examples=400, deadline=None, derandomize=True, database=None)

# Text as kvobs writes it into the message (its own words, and repr() of what it did not choose: request
# ids): printable, with the fragments that end or separate its fields mixed in.
PRINTABLE = st.characters(codec="utf-8").filter(str.isprintable)
TRICKY = st.sampled_from(["); ", ")", "(", " (", "; causes per key: unknown=1", "cause: unknown (", "'", '"', "\\",
                          ")  ", "(group=1, req_id='x')", ". 1 of 1 keys in this load are missing. "])
TEXT = st.lists(TRICKY | st.text(PRINTABLE, max_size=6), max_size=8).map("".join)
ANY_TEXT = st.lists(TRICKY | st.text(max_size=6), max_size=8).map("".join)  # request ids: any str
FLOATS = st.floats(allow_nan=True, allow_infinity=True)
COUNTS = st.integers(0, 10**12)
INTS = st.integers(-(10**12), 10**12)

VALUES = st.fixed_dictionaries({
    "group": st.none() | INTS,
    "req_id": ANY_TEXT,
    "missing": COUNTS,
    "keys": COUNTS,
    "listed": st.lists(st.tuples(st.none() | INTS, st.none() | FLOATS), max_size=16),
    "more": st.none() | st.integers(1, 10**9),
    "end_token_range": st.none() | st.tuples(INTS, INTS),
    "history_keys": COUNTS,
    "history_window_s": FLOATS,
    "cause": st.sampled_from(CAUSES),
    "evidence": TEXT,
    "causes": st.none() | st.dictionaries(st.sampled_from(CAUSES), st.integers(1, 10**6), min_size=2),
})


def logged(text: str) -> explain.LoggedAssertion:
    """What `kvobs explain` reads from a vLLM log line that carries ``text``."""
    [entry] = explain.scan_log(io.BytesIO((PREFIX + text + "\n").encode())).assertions
    return entry


def expected_group(group: int | None) -> int | None:
    return group if group is not None and 0 <= group <= MAX_GROUP else None


def test_every_field_is_defined_once_and_written() -> None:
    assert list(message.FIELDS) == ["group", "req_id", "missing", "keys", "listed", "more", "end_token_range",
                                    "history_keys", "history_window_s", "cause", "evidence", "causes"]
    assert message.MESSAGE == message.SUFFIX + message.BODY + message.CAUSE
    assert (explain.KVOBS_SUFFIX, explain.KVOBS_CAUSE) == (message.SUFFIX_RE, message.CAUSE_RE)


@SETTINGS
@given(VALUES)
def test_what_is_written_is_read_back_field_for_field(values: dict[str, Any]) -> None:
    text = message.render(VLLM, **values)
    read = message.read(text, len(VLLM))
    assert read is not None, text
    for name, field in message.FIELDS.items():
        value = values[name]
        in_maybe = name in ("more", "causes")
        assert read[name] == (None if in_maybe and value is None else field.write(value)), (name, text)
    entry = logged(text)
    assert (entry.vllm_text, entry.kvobs_group, entry.kvobs_req_id, entry.kvobs_cause, entry.kvobs_evidence) == (
        VLLM, expected_group(values["group"]), values["req_id"], values["cause"], values["evidence"]), text


REASONS = st.sampled_from(["capacity", "reset", "store_failed"])
REMOVALS = st.builds(Removal, serial=st.integers(0, 100), time=FLOATS, reason=REASONS,
                     path=st.sampled_from(["lookup", "store", "complete_store", "reset_cache"]),
                     req_id=st.none() | ANY_TEXT)
VERDICTS = st.builds(Verdict, serial=st.integers(0, 100), time=FLOATS, pending=st.booleans())
FACTS = st.builds(KeyFacts, key=st.just(KEY), group=INTS, end_token=st.none() | INTS,
                  state=st.sampled_from([MISSING, NOT_READY]), verdict=st.none() | VERDICTS,
                  last_removal=st.none() | REMOVALS, breach=st.none() | REASONS,
                  breaking_removal=st.none() | REMOVALS, verdicts_dropped=st.booleans())
FAILURES = st.builds(LoadFailure, vllm_message=st.just(VLLM), req_id=ANY_TEXT, num_keys=COUNTS,
                     end_token_range=st.none() | st.tuples(INTS, INTS), missing=st.lists(FACTS, max_size=20),
                     history_keys=COUNTS, history_window_s=FLOATS, now=FLOATS,
                     failing_group=st.none() | INTS)


@SETTINGS
@given(FAILURES)
def test_a_diagnosis_message_is_read_back_as_diagnosed(failure: LoadFailure) -> None:
    """diagnosis.format_message writes it, explain reads it: the group, request, counts, cause and the whole
    of the first key's evidence (which holds ``); `` when a breach's details aged out), as diagnosed."""
    d = diagnose(failure)
    group = failure.failing_group if failure.failing_group is not None or not d.keys else d.keys[0].facts.group
    evidence = d.keys[0].evidence if d.keys else "no missing key was identified"
    read = message.read(d.message, len(VLLM))
    assert read is not None, d.message
    assert (read["group"], read["req_id"], read["missing"], read["keys"], read["cause"], read["evidence"]) == (
        str(group), repr(failure.req_id), str(len(d.keys)), str(failure.num_keys), d.cause, evidence)
    assert read["causes"] == (message.FIELDS["causes"].write(d.causes) if len(d.causes) > 1 else None)
    entry = logged(d.message)
    assert (entry.kvobs_group, entry.kvobs_req_id, entry.kvobs_cause, entry.kvobs_evidence) == (
        expected_group(group), failure.req_id, d.cause, evidence)


def test_evidence_holding_a_parenthesis_and_a_semicolon_is_read_whole() -> None:
    """A breach whose details aged out, then a later removal: explain read the evidence up to the first
    ``); `` until the reader was compiled from the writer's parts."""
    later = Removal(serial=20, time=100.4, reason="store_failed", path="complete_store", req_id="req-c")
    facts = KeyFacts(key=KEY, group=3, end_token=16, state=MISSING, verdict=Verdict(serial=10, time=100.0,
                     pending=False), last_removal=later, breach="reset", breaking_removal=None)
    d = diagnose(LoadFailure(vllm_message=VLLM, req_id="r", num_keys=1, end_token_range=(16, 16), missing=[facts],
                             history_keys=1, history_window_s=0.0, now=100.5))
    evidence = d.keys[0].evidence
    assert "(its details are older than the history); removed again since: store_failed" in evidence
    entry = logged(d.message)
    assert (entry.kvobs_cause, entry.kvobs_evidence) == ("reset_after_lookup", evidence)


def test_a_message_cut_short_is_not_read_as_a_whole() -> None:
    text = message.render(VLLM, group=1, req_id="r", missing=1, keys=1, listed=[(16, 0.5)], more=None,
                          end_token_range=(16, 16), history_keys=1, history_window_s=0.0, cause="unknown",
                          evidence="e", causes=None)
    assert message.read(text, len(VLLM)) is not None
    for cut in (len(VLLM) + 5, text.index(" keys in"), text.index("cause:"), len(text) - 1):
        assert message.read(text[:cut], len(VLLM)) is None, text[:cut]


def test_the_message_module_is_stdlib_only() -> None:
    """explain and the sidecar import it, and diagnosis: nothing of the engine's, nothing outside the stdlib."""
    probe = ("import sys; before = set(sys.modules); import kvobs.message; new = set(sys.modules) - before;"
             "print(','.join(sorted(m for m in new if m.split('.')[0] not in sys.stdlib_module_names)))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "kvobs,kvobs.message"
