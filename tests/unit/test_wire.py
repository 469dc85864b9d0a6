"""kvobs.wire: what the engine writes (encode) is what the sidecar and `kvobs explain` read back (decode), exactly;
and whatever else is on disk is refused field by field, never folded."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from array import array
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest

from kvobs.codes import PATHS, REASONS, pack_flags
from kvobs.hot_path_loader import RemovalRun
from kvobs.wire.decode import decode_record
from kvobs.wire.encode import encode_hello, encode_removals, encode_totals
from kvobs.wire.format import KEYS_LISTED, Ages, Removals, Totals, Writer, key_ref, ref_text

W = Writer("dp0:a.b_c-1", 1234, "abcdef")  # an engine label kvobs writes (the reader takes no other)


def _run(rng: random.Random, batches: int, key_len: int | None = 36, big: int = 0) -> tuple[RemovalRun, list[Any]]:
    counts, times, flags, reqs, keys, res, expect = [], [], [], [], [], [], []
    for i in range(batches):
        n = big if (big and i == 0) else rng.randint(0, 40)
        length = key_len or rng.choice([8, 12, 36, 68])
        batch_keys = [rng.randbytes(length - 4) + rng.randrange(2**32).to_bytes(4, "big") for _ in range(n)]
        ages = [rng.choice([float("nan"), rng.random() * 10 ** rng.randint(-3, 5)]) for _ in range(n)]
        reason, path = rng.randrange(len(REASONS)), rng.randrange(len(PATHS))
        req = rng.choice([None, f"req-{i}", 'q"uo\\te\n', "ünï"])
        counts.append(n)
        times.append(rng.random() * 1e5)
        flags.append(pack_flags(reason, path))
        reqs.append(req)
        keys.extend(batch_keys)
        res.extend(ages)
        expect.append((reason, path, req, n, batch_keys, ages))
    run = RemovalRun(17, array("q", map(hash, keys)), array("q", counts), array("d", times), array("B", flags),
                     reqs, keys, array("d", res))
    return run, expect


def _decode(lines: list[str]) -> list[Any]:
    return [decode_record(json.loads(line)) for line in lines]


@pytest.mark.parametrize("key_len", [36, None])
def test_removal_runs_read_back_exactly(key_len: int | None) -> None:
    rng = random.Random(key_len or 1)
    for _ in range(50):
        run, expect = _run(rng, rng.randint(1, 30), key_len)
        (record,) = _decode(encode_removals(W, run, wall_offset=1000.0))
        assert isinstance(record, Removals) and record.writer == W and record.first_serial == 17
        for got, (reason, path, req, n, keys, ages), t in zip(record.batches(), expect, run.times, strict=True):
            _serial, when, r, p, req_id, count, refs, listed_ages = got
            assert (r, p, req_id, count) == (REASONS[reason], PATHS[path], req, n)
            assert when == t + 1000.0
            assert [ref_text(ref) for ref in refs] == [key_ref(k) for k in keys]
            for a, b in zip(listed_ages, ages, strict=True):
                assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6)


def test_a_huge_batch_lists_its_first_keys_and_carries_every_age() -> None:
    run, _ = _run(random.Random(3), 3, big=KEYS_LISTED * 2 + 5)
    records = _decode(encode_removals(W, run, 0.0))
    removals, *more = records
    assert isinstance(removals, Removals) and removals.counts[0] == KEYS_LISTED * 2 + 5
    assert removals.listed[0] == KEYS_LISTED
    assert all(isinstance(r, Ages) for r in more)
    assert sum(len(r.ages) for r in more) == KEYS_LISTED + 5


def _line(**changes: Any) -> dict[str, Any]:
    run, _ = _run(random.Random(5), 4)
    record = json.loads(encode_removals(W, run, 0.0)[0])
    record.update(changes)
    return record


@pytest.mark.parametrize(
    "record",
    [
        _line(n=5),  # columns of another length
        _line(t="not base64!"),
        _line(req=[1, 2, 3, 4]),
        _line(e=""),
        _line(e=["dp0"]),
        _line(pid=-1),
        _line(to=float("inf")),
        _line(to=1e300),
        _line(ages="AAAA"),  # one float32 where the listed keys need more
        json.loads(encode_totals(W, 1.0, {"evicted": {"capacity": 3}}, history_keys=1, history_window_s=0.5, seq=1))
        | {"evicted": {"capacity": 1e300}},
        json.loads(encode_totals(W, 1.0, {}, history_keys=1, history_window_s=0.5, seq=1)) | {"hist_window": -1},
        json.loads(encode_totals(W, 1.0, {}, history_keys=1, history_window_s=0.5, seq=1)) | {"failures": {"": 1}},
        json.loads(encode_totals(W, 1.0, {}, history_keys=1, history_window_s=0.5, seq=1)) | {"t": float("nan")},
        json.loads(encode_hello(W, 1.0, version="1", vllm_version="0.33.0", history_size=10, hot_path="python"))
        | {"history_size": "big"},
        {"k": 5, "e": "dp0", "pid": 1},  # a kind that is no label (a newer writer's kind is read: test_wire_compat)
        [1, 2],
    ],
)
def test_records_that_do_not_fit_are_refused(record: Any) -> None:
    assert decode_record(record) is None


def test_the_sidecars_modules_import_neither_numpy_nor_the_hot_path_nor_vllm() -> None:
    probe = (
        "import sys, kvobs.sidecar.server, kvobs.explain, kvobs.cli;"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('numpy', 'vllm', 'torch')"
        " or m.startswith('kvobs.hot_')"  # the hot path's modules, its loader and its list
        " or m in ('kvobs.history', 'kvobs.observer', 'kvobs.journal', 'kvobs.wire.encode'));"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == ""


def test_the_decoder_is_stdlib_only() -> None:
    """What the sidecar, its checkpoint and `kvobs explain` read with loads the standard library and the
    format alone; the package itself loads none of its modules."""
    probe = (
        "import sys; before = set(sys.modules); import kvobs.wire;"
        "pkg = sorted(m for m in set(sys.modules) - before if m.split('.')[0] == 'kvobs');"
        "import kvobs.wire.decode;"
        "new = set(sys.modules) - before;"
        "print(','.join(pkg)); print(','.join(sorted(m for m in new if m.split('.')[0] != 'kvobs'"
        " and m.split('.')[0] not in sys.stdlib_module_names))); print(','.join(sorted(m for m in new"
        " if m.split('.')[0] == 'kvobs')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    package, third_party, kvobs_modules = out.stdout.splitlines()
    assert package == "kvobs,kvobs.wire"
    assert third_party == ""
    assert kvobs_modules == ("kvobs,kvobs.codes,kvobs.metric_catalogue,kvobs.wire,kvobs.wire.decode,kvobs.wire.format,"
                             "kvobs.wire.histogram")

def _checkpoint_and_lines() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A sidecar checkpoint folded from one totals and one hello line, and those two lines."""
    from kvobs.sidecar.state import SidecarState

    totals = json.loads(encode_totals(W, 2.0, {"failures": {"unknown": 2}, "evicted": {"reset": 1}},
                                      history_keys=3, history_window_s=0.5, seq=1))
    hello = json.loads(encode_hello(W, 1.0, version="1", vllm_version="0.33.0", history_size=10, hot_path="python"))
    state = SidecarState()
    for line in (hello, totals):
        state.apply(decode_record(line), "x-1234")
    saved = json.loads(json.dumps(state.to_json()))
    assert SidecarState.from_json(saved).to_json() | {"saved_at": 0} == saved | {"saved_at": 0}
    return saved, totals, hello


@pytest.mark.parametrize("label", ["", "x" * 65])
def test_the_checkpoint_refuses_a_counter_label_the_journal_decoder_refuses(label: str) -> None:
    """The checkpoint reader counts with the journal decoder's checks (a label value it does not know is
    kept by both: tests/unit/test_wire_compat.py)."""
    from kvobs.sidecar.state import SidecarState

    saved, totals, _ = _checkpoint_and_lines()
    assert decode_record(totals | {"failures": {label: 1}}) is None
    [engine] = saved["engines"]
    [live] = engine["live"].values()
    live["counters"]["failures"] = {label: 1}
    with pytest.raises(ValueError, match="failures counters"):
        SidecarState.from_json(saved)
    engine["retired"] = {"failures": {label: 1}}
    del engine["live"]["1234/abcdef"]
    with pytest.raises(ValueError, match="failures counters"):
        SidecarState.from_json(saved)


@pytest.mark.parametrize(("field", "value"), [("reason", ""), ("observing", "yes"), ("history_size", -1),
                                              ("version", 3)])
def test_the_checkpoint_refuses_a_hello_the_journal_decoder_refuses(field: str, value: Any) -> None:
    """A hello's label values (``kvobs_observing{reason}``, ``kvobs_build_info``) are checked alike."""
    from kvobs.sidecar.state import SidecarState

    saved, _, hello = _checkpoint_and_lines()
    assert decode_record(hello | {field: value}) is None
    [engine] = saved["engines"]
    engine["hello"][field] = value
    with pytest.raises(ValueError, match="bad hello"):
        SidecarState.from_json(saved)


def test_the_checkpoint_refuses_a_writer_the_journal_decoder_refuses() -> None:
    from kvobs.sidecar.state import SidecarState

    saved, totals, _ = _checkpoint_and_lines()
    assert decode_record(totals | {"run": "r" * 65}) is None
    [engine] = saved["engines"]
    [live] = engine["live"].values()
    live["run"] = "r" * 65
    with pytest.raises(ValueError, match="bad live writer"):
        SidecarState.from_json(saved)
    saved, _, _ = _checkpoint_and_lines()
    saved["engines"][0]["hello"]["writer"][1] = -1
    with pytest.raises(ValueError, match="bad hello"):
        SidecarState.from_json(saved)


def _real_report(directory: Path) -> Path:
    """A failure report as kvobs writes one, from a failed load through the real observer and sink."""
    from kvobs.diagnosis import MISSING
    from kvobs.journal import JournalSink
    from kvobs.observer import Observer, Unloadable
    from kvobs.options import Options

    observer = Observer(Options(engine="0"))
    sink = JournalSink(directory, observer.options, "test")
    observer.add_sink(sink)
    diagnosis = observer.load_failed("Chunk b'x' not found in cache", "req", 1, None,
                                     [Unloadable(b"\1" * 36, 0, None, MISSING)], 0)
    observer.publish_failure(diagnosis, AssertionError(diagnosis.message))
    sink.close()
    [report] = (directory / "failures").glob("*.json")
    return report


@pytest.mark.parametrize("engine", ["0", "dp0:a.b_c-1", "e" * 64, "e" * 65, "../dp0", "node a", "-dp0", "dp0/1",
                                    "dpé", "", "e" * 256])
def test_the_reader_the_option_check_and_the_api_take_the_same_engine_labels(engine: str, tmp_path: Path) -> None:
    """Issue 21, class 1: the reader took any 1-256 characters as an ``engine`` where the option check and
    the API take only safe file names, so a record the writer never writes was read, and a label read could
    not be asked for. One predicate (``wire.format.is_engine_label``) for all three."""
    from kvobs.options import OptionError, parse_options
    from kvobs.sidecar.query import QueryError, parse_params
    from kvobs.wire.decode import decode_report

    try:
        parse_options({"engine": engine})
        by_option = True
    except OptionError:
        by_option = False
    try:
        parse_params(urlencode({"engine": engine}))
        by_api = True
    except QueryError:
        by_api = False
    totals = json.loads(encode_totals(W, 1.0, {}, history_keys=1, history_window_s=0.5, seq=1)) | {"e": engine}
    by_journal = decode_record(totals) is not None
    report = json.loads(_real_report(tmp_path).read_text()) | {"engine": engine}
    by_report = decode_report("000000000000001-0-1-0", report) is not None
    assert by_option == by_api == by_journal == by_report, (by_option, by_api, by_journal, by_report)


def test_the_option_check_and_the_api_say_the_same_engine_rule() -> None:
    from kvobs.options import OptionError, parse_options
    from kvobs.sidecar.query import QueryError, parse_params
    from kvobs.wire.format import ENGINE_LABEL_RULE

    with pytest.raises(OptionError) as option:
        parse_options({"engine": "../dp0"})
    with pytest.raises(QueryError) as api:
        parse_params("engine=..%2Fdp0")
    assert ENGINE_LABEL_RULE in str(option.value) and ENGINE_LABEL_RULE in str(api.value)


def test_totals_leave_zero_counts_out_and_put_values_older_readers_refuse_under_ext() -> None:
    """A totals line as every reader since kvobs 0.1.0 reads it: zero counts left out, a count under a label
    value 0.1.0's reader would refuse the line for under ``ext`` (the old reader end to end:
    tests/unit/test_wire_compat.py)."""
    counters = {"evicted": dict.fromkeys(REASONS, 0) | {"capacity": 7}, "near": dict.fromkeys(REASONS, 0)}
    line = json.loads(encode_totals(W, 1.0, counters, history_keys=1, history_window_s=0.5, seq=1))
    assert line["evicted"] == {"capacity": 7} and line["near"] == {} and "ext" not in line
    counters["failures"] = {"evicted_after_lookup": 2, "cause_of_tomorrow": 1}
    line = json.loads(encode_totals(W, 1.0, counters, history_keys=1, history_window_s=0.5, seq=2))
    assert line["failures"] == {"evicted_after_lookup": 2} and line["ext"] == {"failures": {"cause_of_tomorrow": 1}}
    totals = decode_record(line)
    assert isinstance(totals, Totals)
    assert totals.counters["failures"] == {"evicted_after_lookup": 2.0, "cause_of_tomorrow": 1.0}
    assert totals.unknown == ("label_value:failures=cause_of_tomorrow",)
