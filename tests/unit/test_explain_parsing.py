"""kvobs.explain's log reading, without vLLM: wordings, dedup, kvobs's suffix, arbitrary bytes."""

from __future__ import annotations

import io
import json
from pathlib import Path

from hypothesis import given, settings, strategies as st

from kvobs.explain import MAX_LINE_CHARS, ExplainError, render, scan_log
from kvobs.explain_evidence import add_directory_evidence
from kvobs.logtext import COMPRESSED

KEY = b"\x07" * 32 + (3).to_bytes(4, "big")
LINE = f"(EngineCore_DP2 pid=7) ERROR 11-29 10:00:00 [core.py:1] AssertionError: Chunk {KEY!r} not found in cache"


def _find(text: bytes) -> list:
    return scan_log(io.BytesIO(text)).assertions


def test_decodes_key_engine_and_time() -> None:
    [entry] = _find(LINE.encode() + b"\n")
    assert (entry.key, entry.engine, entry.log_time, entry.state) == (KEY, "2", "11-29 10:00:00", "missing")
    assert entry.key_ref == "0707070707070707/3" and entry.vllm_text == f"Chunk {KEY!r} not found in cache"


def test_repeats_are_one_assertion_and_source_lines_are_not_assertions() -> None:
    text = (LINE + "\n" + '    assert chunk is not None, f"Chunk {key!r} not found in cache"\n' + LINE + "\n").encode()
    [entry] = _find(text)
    assert entry.occurrences == 2


def test_reads_kvobs_suffix() -> None:
    line = (LINE + " (group=3, req_id='req-\\'x'). 1 of 2 keys in this load are missing. ... cause: "
            "coverage_mismatch (this request's lookups never reported the chunk; last removed 1.0s ago (capacity))")
    [entry] = _find(line.encode())
    assert (entry.kvobs_group, entry.kvobs_req_id, entry.kvobs_cause) == (3, "req-'x", "coverage_mismatch")
    assert entry.kvobs_evidence is not None and entry.kvobs_evidence.endswith("(capacity)")


def test_ansi_colours_and_older_process_names() -> None:
    line = b"\x1b[1;36m(EngineCore_0 pid=271)\x1b[0;0m ERROR 09-21 17:33:21 [core.py:714] AssertionError: Block 1234 " \
           b"is not ready for reading\n"
    [entry] = _find(line)
    assert (entry.noun, entry.key, entry.key_text, entry.engine, entry.state) == ("Block", None, "1234", "0",
                                                                                  "not_ready")
    assert "not a bytes key" in render([entry], 0, False, "x")


def test_an_over_long_line_is_cut_not_loaded_whole() -> None:
    text = b"x" * (3 * MAX_LINE_CHARS) + b"\n" + LINE.encode() + b"\n"
    [entry] = _find(text)
    assert entry.line == 2


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.binary(max_size=2000), st.binary(max_size=200))
def test_arbitrary_bytes_never_raise(prefix: bytes, suffix: bytes) -> None:
    """Nothing but ExplainError (a compression kvobs cannot decode, said so: exit 2) ever leaves explain."""
    for text in (prefix, prefix + b"Chunk b'" + suffix + b"' not found in cache" + suffix, prefix + LINE.encode()):
        try:
            scan = scan_log(io.BytesIO(text))
            entries, dropped = scan.assertions, scan.not_shown
        except ExplainError as exc:
            assert text.startswith(tuple(magic for magic, _, opener in COMPRESSED if opener is None)), exc
            continue
        assert isinstance(render(entries, dropped, False, "fuzz"), str)


def test_damaged_kvobs_records_are_skipped_not_raised(tmp_path: Path) -> None:
    """Damaged journal lines and reports (wrong types, out-of-range numbers) never crash explain, and
    never show up as evidence; the intact line beside them does."""
    from array import array

    from kvobs.codes import pack_flags
    from kvobs.hot_path_loader import RemovalRun
    from kvobs.wire.encode import encode_removals
    from kvobs.wire.format import Writer

    directory = tmp_path / "kvobs"
    (directory / "journal").mkdir(parents=True)
    (directory / "failures").mkdir()
    run = RemovalRun(0, array("q", [hash(KEY)]), array("q", [1]), array("d", [5.0]), array("B", [pack_flags(0, 0)]),
                     ["req-b"], [KEY], array("d", [2.5]))
    good = json.loads(encode_removals(Writer("dp2", 7, "r"), run, 1e9)[0])
    damaged = [good | {"t": "soon"}, good | {"to": 1e300}, good | {"ages": ["x"]}, good | {"req": [[1]]}]
    (directory / "journal" / "dp2-7.000000.jsonl").write_text(
        "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in [*damaged, good])
    )
    (directory / "failures" / "1.json").write_text(
        json.dumps({"vllm_message": f"Chunk {KEY!r} not found in cache", "time": "later", "missing": {"a": 1}})
    )
    [entry] = _find(LINE.encode() + b"\n")
    add_directory_evidence([entry], directory)
    assert len(entry.removals) == 1 and entry.reports == []
    (removal,) = entry.removals
    assert (removal["req_id"], removal["reason"], removal["residency_s"]) == ("req-b", "capacity", 2.5)
    assert isinstance(render([entry], 0, True, "log"), str)


def test_journal_lines_are_read_by_their_fields_not_the_order_of_their_keys(tmp_path: Path) -> None:
    """explain reads the journal with the sidecar's decoder: a removals line whose keys come in another
    order (``k`` last, other separators) is found as it is in kvobs's order, and a damaged one is refused
    in either order alike (explain used to look for '"k":"removals"' in a line's first 32 bytes)."""
    from array import array

    from kvobs.codes import pack_flags
    from kvobs.hot_path_loader import RemovalRun
    from kvobs.wire.decode import decode_line
    from kvobs.wire.encode import encode_removals
    from kvobs.wire.format import Writer

    run = RemovalRun(0, array("q", [hash(KEY)]), array("q", [1]), array("d", [5.0]), array("B", [pack_flags(2, 0)]),
                     ["req-c"], [KEY], array("d", [1.5]))
    [line] = encode_removals(Writer("dp2", 7, "r"), run, 1e9)
    good = json.loads(line)
    reordered = dict(reversed(list(good.items())))
    assert next(iter(reordered)) != "k" and list(reordered)[-1] == "k"
    for damaged in (good | {"t": "soon"}, good | {"to": 1e300}, good | {"k": ["removals"]}, good | {"pid": -1}):
        for record in (damaged, dict(reversed(list(damaged.items())))):
            assert decode_line(json.dumps(record).encode()) is None
    assert decode_line(json.dumps(reordered).encode()) == decode_line(line.encode())
    directory = tmp_path / "kvobs"
    (directory / "journal").mkdir(parents=True)
    (directory / "journal" / "dp2-7.000000.jsonl").write_text(
        json.dumps(dict(reversed(list((good | {"to": 1e300}).items())))) + "\n" + json.dumps(reordered) + "\n"
    )
    [entry] = _find(LINE.encode() + b"\n")
    add_directory_evidence([entry], directory)
    [removal] = entry.removals
    assert (removal["req_id"], removal["reason"], removal["residency_s"]) == ("req-c", "reset", 1.5)


def test_a_text_line_with_double_quotes_is_read_as_text() -> None:
    """Quotes around part of a text line are not JSON to decode: the key is read from the text."""
    key = b'\x00"' + b"\x01" * 30 + (1).to_bytes(4, "big")
    line = f'ERROR "engine" said: AssertionError: Chunk {key!r} not found in cache; see "runbook"\n'
    [entry] = _find(line.encode())
    assert entry.key == key


def test_json_inside_json_is_decoded_to_the_same_key() -> None:
    """Docker's json-file around vLLM's JSON formatter: the key's escapes are undone twice."""
    inner = json.dumps({"message": "fatal", "exc_info": f"Traceback ...\n{LINE}\n"})
    [entry] = _find(json.dumps({"log": inner + "\n", "stream": "stderr"}).encode() + b"\r\n")
    assert (entry.key, entry.engine) == (KEY, "2")
