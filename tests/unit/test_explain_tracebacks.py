"""kvobs.explain_tracebacks through kvobs.explain.scan_log, without vLLM: every release's log prefix, tracebacks
as people paste them, kvobs's own line, bounds, arbitrary bytes.

The prefixes are those vLLM 0.30.0 to 0.34.0 write (read in each release's vllm/logger.py,
vllm/logging_utils/formatter.py and vllm/utils/system_utils.py): 0.30.0 prints the process in
``decorate_logs``' stdout wrapper, ``(EngineCore_DP0 pid=7) `` in cyan when colour is on, before the
formatter's ``ERROR <time> [file:line] ``; 0.31.0 and later put ``(EngineCore_DP0 pid=7)`` in the format
itself (``ColoredFormatter`` colours it, the level, the time and the file). vLLM's NewLineFormatter repeats a
record's prefix on each line of it, ending the line before with ``\\r``.
"""

from __future__ import annotations

import io
import json

import pytest
from hypothesis import given, settings, strategies as st

from kvobs import explain_tracebacks
from kvobs.explain import ExplainError, as_json, render, scan_log
from kvobs.explain_tracebacks import OFFLOAD_CODE, offload_file

SCHED = "distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py"
SITE_PKG = "/usr/local/lib/python3.12/dist-packages/vllm/"
TRACEBACK = [
    "EngineCore encountered a fatal error.",
    "Traceback (most recent call last):",
    f'  File "{SITE_PKG}v1/engine/core.py", line 1323, in run_engine_core',
    "    engine_core.run_busy_loop()",
    f'  File "{SITE_PKG}v1/core/sched/scheduler.py", line 900, in schedule',
    "    meta = self.connector.build_connector_meta(scheduler_output)",
    "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
    '  File "/opt/venv/lib/python3.12/site-packages/kvobs/vllm/boundary.py", line 174, in call',
    "    result = method(self, *args, **kwargs)",
    f'  File "{SITE_PKG}{SCHED}", line 2089, in _build_store_jobs',
    "    assert len(offload_keys) == len(offload_block_ids)",
    "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
    "AssertionError",
]
PREFIXES = {
    "0.30.0": "\x1b[0;36m(EngineCore_DP{dp} pid=271)\x1b[0;0m \x1b[31mERROR\x1b[0m \x1b[90m12-06 10:00:00\x1b[0m "
              "\x1b[90m[core.py:1155]\x1b[0m ",
    "0.30.0 no colour": "(EngineCore_DP{dp} pid=271) ERROR 12-06 10:00:00 [core.py:1155] ",
    "0.31.0+": "\x1b[0;36m(EngineCore_DP{dp} pid=271)\x1b[0;0m \x1b[31mERROR\x1b[0m \x1b[90m12-06 10:00:00\x1b[0m "
               "\x1b[90m[core.py:1155]\x1b[0m ",
    "0.31.0+ no colour": "(EngineCore_DP{dp} pid=271) ERROR 12-06 10:00:00 [core.py:1155] ",
    "VLLM_LOGGING_PREFIX": "node-3 | (EngineCore_DP{dp} pid=271) ERROR 12-06 10:00:00 [core.py:1155] ",
    "older process name": "(EngineCore_{dp} pid=271) ERROR 12-06 10:00:00 [core.py:1155] ",
}


def _scan(text: str | bytes) -> list[explain_tracebacks.LoggedException]:
    data = text.encode() if isinstance(text, str) else text
    return scan_log(io.BytesIO(data)).exceptions


def _log(prefix: str, lines: list[str] = TRACEBACK, end: str = "\r\n") -> str:
    return "INFO 12-06 09:59:59 [api_server.py:1] Started.\n" + end.join(prefix + line for line in lines) + "\n"


@pytest.mark.parametrize("style", sorted(PREFIXES))
def test_each_releases_prefix_names_the_site(style: str) -> None:
    [entry] = _scan(_log(PREFIXES[style].format(dp=2)))
    assert entry.site == (SCHED, "_build_store_jobs", 2089)
    assert (entry.expression, entry.statement) == ("len(offload_keys) == len(offload_block_ids)", "assert")
    assert (entry.exception_type, entry.message, entry.engine, entry.log_time) == (
        "AssertionError", None, "2", "12-06 10:00:00")
    assert entry.line == 3 and entry.seen_in == ["traceback"]


def test_continuation_lines_without_the_prefix_and_with_lost_indentation() -> None:
    """As reports paste them: only the header carries the prefix (vLLM #52170), or every line its prefix
    and no indentation (a copy that collapsed whitespace)."""
    header, *rest = TRACEBACK[1:]
    pasted = "(EngineCore pid=10329) ERROR 08-13 06:13:44 [core.py:1332] " + header + "\n" + "\n".join(rest) + "\n"
    [entry] = _scan(pasted)
    assert entry.site == (SCHED, "_build_store_jobs", 2089) and entry.engine == "0"
    flat = _log(PREFIXES["0.31.0+ no colour"].format(dp=0), [line.strip() for line in TRACEBACK], "\n")
    [entry] = _scan(flat)
    assert entry.site == (SCHED, "_build_store_jobs", 2089)
    assert entry.expression == "len(offload_keys) == len(offload_block_ids)"


def test_a_bare_name_is_the_source_line_of_a_multi_line_assert_not_the_exception() -> None:
    """vLLM #50454's traceback shows one line of a multi-line assert: ``num_locally_computed_tokens``."""
    lines = ["Traceback (most recent call last):",
             f'  File "{SITE_PKG}{SCHED}", line 734, in update_state_after_alloc',
             "    num_locally_computed_tokens", "AssertionError"]
    [entry] = _scan("\n".join(lines) + "\n")
    assert (entry.function, entry.site_line, entry.expression, entry.statement) == (
        "update_state_after_alloc", 734, "num_locally_computed_tokens", "")
    assert entry.exception_type == "AssertionError"


def test_other_exception_types_messages_and_chained_tracebacks() -> None:
    lines = ["Traceback (most recent call last):",
             f'  File "{SITE_PKG}v1/kv_offload/tiering/manager.py", line 88, in prepare_store',
             "    state = self._requests[req_context.req_id]", "KeyError: 'req-9'", "",
             "The above exception was the direct cause of the following exception:", "",
             "Traceback (most recent call last):",
             f'  File "{SITE_PKG}v1/engine/core.py", line 1323, in run_engine_core',
             "    raise EngineDeadError() from e",
             "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue."]
    [entry] = _scan("\n".join(lines) + "\n")
    assert (entry.file, entry.function, entry.exception_type, entry.message) == (
        "v1/kv_offload/tiering/manager.py", "prepare_store", "KeyError", "'req-9'")
    assert entry.expression == "state = self._requests[req_context.req_id]" and entry.statement == ""


def test_prepare_loads_chunk_and_exceptions_outside_offloading_code_are_not_offload_exceptions() -> None:
    chunk = ["Traceback (most recent call last):",
             f'  File "{SITE_PKG}v1/kv_offload/cpu/manager.py", line 242, in _prepare_load',
             '    assert chunk is not None, f"Chunk {key!r} not found in cache"',
             "AssertionError: Chunk b'\\x00\\x01' not found in cache"]
    scan = scan_log(io.BytesIO(_log(PREFIXES["0.31.0+"].format(dp=0), chunk).encode()))
    assert scan.exceptions == [] and len(scan.assertions) == 1  # explained as before, by kvobs.explain
    elsewhere = [*TRACEBACK[:7], "AssertionError: num_new_tokens > 0"]  # innermost vLLM frame: the scheduler's
    assert _scan(_log("", elsewhere)) == []
    glue_last = [*TRACEBACK[:-4], TRACEBACK[-1]]  # innermost: kvobs's kvobs/vllm/boundary.py, not vLLM's
    assert _scan(_log("", glue_last)) == []
    assert offload_file("/x/site-packages/kvobs/vllm/connector.py") is None
    assert offload_file("C:\\py\\Lib\\site-packages\\vllm\\v1\\kv_offload\\base.py") == "v1/kv_offload/base.py"
    assert all(prefix.startswith(("v1/", "distributed/")) for prefix in OFFLOAD_CODE)


def test_repeats_are_counted_and_engines_kept_apart() -> None:
    text = (_log(PREFIXES["0.31.0+"].format(dp=0)) + _log(PREFIXES["0.31.0+"].format(dp=0))
            + _log(PREFIXES["0.31.0+"].format(dp=1)) + _log(""))
    zero, one = _scan(text)
    assert (zero.engine, zero.occurrences, one.engine, one.occurrences) == ("0", 3, "1", 1)


KVOBS_LINE = ("kv offload exception at {file}:2089 in _build_store_jobs (assert len(offload_keys) == "
              "len(offload_block_ids)); through the connector's scheduler-side build_connector_meta; AssertionError: ; "
              "requests: ['req-a', \"req-'b\"]; cause: vllm_assertion; vLLM 0.34.0")


def test_kvobs_line_and_the_traceback_are_one_death() -> None:
    prefix = PREFIXES["0.31.0+"].format(dp=3)
    text = prefix + KVOBS_LINE.format(file=SCHED) + "\n" + _log(prefix)
    [entry] = _scan(text)
    assert entry.seen_in == ["kvobs_log", "traceback"] and entry.occurrences == 1 and entry.engine == "3"
    assert entry.kvobs == {"side": "scheduler", "method": "build_connector_meta", "req_ids": ["req-a", "req-'b"],
                           "cause": "vllm_assertion", "vllm": "0.34.0", "recomputed": False}
    assert (entry.expression, entry.statement) == ("len(offload_keys) == len(offload_block_ids)", "assert")
    out = render([], 0, False, "log", exceptions=[entry])
    assert out.startswith("1 offload exception in log") and "ObservedOffloadingConnector" not in out
    assert "through the connector's scheduler-side build_connector_meta, cause vllm_assertion" in out


def test_a_survived_exception_is_said_to_be_survived() -> None:
    """Survive mode answered vLLM in the exception's place (a lookup that raised): kvobs's line ends so, there
    is no traceback, and explain says the engine went on."""
    line = (PREFIXES["0.31.0+"].format(dp=0) + KVOBS_LINE.format(file=SCHED).replace(
        "build_connector_meta", "get_num_new_matched_tokens") + "; computed instead (kvobs survive)\n")
    [entry] = _scan(line)
    assert entry.seen_in == ["kvobs_log"] and entry.kvobs is not None and entry.kvobs["recomputed"] is True
    assert "survived: kvobs survive answered vLLM in its place" in render([], 0, False, "log", exceptions=[entry])
    [plain] = _scan(PREFIXES["0.31.0+"].format(dp=0) + KVOBS_LINE.format(file=SCHED) + "\n")
    assert plain.kvobs is not None and plain.kvobs["recomputed"] is False
    assert "survived" not in render([], 0, False, "log", exceptions=[plain])


def test_a_manager_side_line_is_read() -> None:
    """Without kvobs's connector the manager's taps write the line, naming the manager's method."""
    line = ("kv offload exception at v1/kv_offload/cpu/manager.py:261 in complete_load (assert chunk.ref_cnt > 0); "
            "through the offload manager's complete_load; AssertionError: Chunk b'x' ref_cnt is already 0; "
            "requests: ['req-x']; cause: vllm_assertion; vLLM 0.34.0")
    [entry] = _scan(PREFIXES["0.31.0+"].format(dp=0) + line + "\n")
    assert entry.site == ("v1/kv_offload/cpu/manager.py", "complete_load", 261)
    assert entry.kvobs == {"side": "manager", "method": "complete_load", "req_ids": ["req-x"],
                           "cause": "vllm_assertion", "vllm": "0.34.0", "recomputed": False}
    assert entry.message == "Chunk b'x' ref_cnt is already 0"
    assert "kvobs (in the log): through the offload manager's complete_load, cause vllm_assertion" in render(
        [], 0, False, "log", exceptions=[entry])


def test_json_formatter_exc_info_is_decoded() -> None:
    """vLLM's JSON formatter (0.32.0+) puts the traceback in ``exc_info``; Docker's json-file wraps it again."""
    record = json.dumps({"asctime": "2026-12-06 10:00:00", "levelname": "ERROR", "processName": "EngineCore_DP1",
                         "message": "EngineCore encountered a fatal error.", "exc_info": "\n".join(TRACEBACK[1:])})
    [entry] = _scan(json.dumps({"log": record + "\n", "stream": "stdout"}) + "\n")
    assert entry.site == (SCHED, "_build_store_jobs", 2089) and entry.engine == "1"


def test_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(explain_tracebacks, "MAX_EXCEPTIONS", 2)
    text = "".join(_log("", [line.replace("line 2089", f"line {n}") for line in TRACEBACK]) for n in range(5))
    scan = scan_log(io.BytesIO((text + text).encode()))
    assert len(scan.exceptions) == 2 and scan.exceptions_not_shown == 3
    assert "3 more distinct exceptions not shown" in render([], 0, False, "x", (), scan.exceptions, 3)


def test_reports_attach_by_site_and_type() -> None:
    [entry] = _scan(_log(""))
    site = {"file": SCHED, "function": "_build_store_jobs", "line": 2089}
    good = {"id": "r1", "site": site, "exception_type": "AssertionError", "cause": "vllm_assertion",
            "method": "build_connector_meta", "side": "scheduler", "req_ids": ["req-a"],
            "requests": [{"req_id": "req-a", "recorded": True, "events": [
                {"method": "on_new_request", "detail": "status='WAITING'"},
                {"method": "request_finished", "detail": "status='FINISHED_ABORTED'"}]}, "junk", {"events": 3}]}
    other_line = good | {"id": "r2", "site": site | {"line": 2090}}
    other_type = good | {"id": "r3", "exception_type": "KeyError"}
    damaged = {"id": "r4", "site": "x", "requests": {"a": 1}}
    explain_tracebacks.attach([good, other_line, other_type, damaged, "x"], [entry])
    assert [r["id"] for r in entry.reports] == ["r1"]
    out = render([], 0, True, "log", exceptions=[entry])
    assert "req-a: on_new_request (status='WAITING') -> request_finished (status='FINISHED_ABORTED')" in out
    [as_dict] = explain_tracebacks.as_json([entry])
    assert as_dict["report_requests"] == [[{"req_id": "req-a", "recorded": True,
                                            "events": ["on_new_request", "request_finished"]}, {
                                               "req_id": None, "recorded": None, "events": []}]]


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.binary(max_size=600), st.binary(max_size=200), st.integers(0, len(TRACEBACK)))
def test_arbitrary_bytes_around_and_inside_a_traceback_never_raise(junk: bytes, inner: bytes, at: int) -> None:
    lines = [line.encode() for line in TRACEBACK]
    lines.insert(at, inner)
    kvobs_line = KVOBS_LINE.format(file=SCHED).encode()
    for text in (junk + b"\n".join(lines), b"\n".join(lines) + junk, kvobs_line[: len(junk)] + junk,
                 junk + kvobs_line + inner):
        try:
            scan = scan_log(io.BytesIO(text))
        except ExplainError:
            continue
        assert isinstance(render(scan.assertions, 0, True, "fuzz", (), scan.exceptions, 0), str)
        json.dumps([as_json(scan.assertions), explain_tracebacks.as_json(scan.exceptions)])
