"""`kvobs explain` on the log vLLM 0.33.0 itself writes when an EngineCore dies on a failed load.

The logs come from ``tests/support/crash_log.py``: a real manager raising the real assertion, logged by
vLLM's own logging setup. The ``Block ...`` wording of vLLM <= 0.28 is not runnable here; its
lines are the same real lines with the noun vLLM used then (the format string was otherwise
identical: ``f"Block {block_hash!r} not found in cache"``).
"""

from __future__ import annotations

import bz2
import codecs
import contextlib
import gzip
import io
import json
import lzma
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvobs import cli
from kvobs.explain import scan_log
from tests.support.services import ROOT, Sidecar, free_port

pytestmark = pytest.mark.slow

CRASH_LOG = "tests.support.crash_log"  # run as a module from the repository root


def crash_log(path: Path, mode: str, state: str, dp: int, directory: Path | None = None) -> Path:
    args = [sys.executable, "-m", CRASH_LOG, mode, state, str(dp)]
    if directory is not None:
        args.append(str(directory))
    run = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "AssertionError: Chunk b'" in run.stdout, run.stdout[-2000:]
    path.write_text(run.stdout)
    return path


def explain(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvobs.cli", "explain", *args], cwd=ROOT, input=
                          None if stdin is None else stdin.decode("latin-1"), capture_output=True, text=True,
                          timeout=60)


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("logs")
    kvobs_dir = base / "kvobs"
    return {
        "bare": crash_log(base / "bare.log", "bare", "missing", 1),
        "not_ready": crash_log(base / "not_ready.log", "bare", "not_ready", 0),
        "kvobs": crash_log(base / "kvobs.log", "kvobs", "missing", 0, kvobs_dir),
        "dir": kvobs_dir,
    }


def test_chunk_wording_without_kvobs_data_says_what_the_log_tells(logs: dict[str, Path]) -> None:
    run = explain(str(logs["bare"]))
    assert run.returncode == 0, run.stderr
    out = run.stdout
    # One assertion, although the traceback also shows the assert statement's source line.
    assert out.startswith(f"1 offload assertion in {logs['bare']}\n")
    assert "engine 1" in out and "Chunk b'\\x00" in out
    assert "key: block hash 0000000000000000… (32 bytes), KV-cache group 0" in out
    assert "(vLLM >= 0.29): the chunk was not in the CPU tier" in out
    assert "cannot tell a coverage mismatch" in out
    assert '"spec_name":"ObservedOffloadingSpec","spec_module_path":"kvobs.vllm"' in out  # what to enable


def test_not_ready_wording_names_store_in_flight(logs: dict[str, Path]) -> None:
    run = explain(str(logs["not_ready"]))
    assert run.returncode == 0, run.stderr
    assert "is not ready for reading' (vLLM >= 0.29)" in run.stdout and "engine 0" in run.stdout
    assert "This log alone names the cause: store_in_flight." in run.stdout


def test_block_wording_of_older_vllm(logs: dict[str, Path], tmp_path: Path) -> None:
    old = tmp_path / "old.log"
    old.write_text(logs["bare"].read_text().replace("AssertionError: Chunk b'", "AssertionError: Block b'")
                   .replace("EngineCore_DP1", "EngineCore_0"))
    run = explain(str(old))
    assert run.returncode == 0, run.stderr
    assert "'Block ... not found in cache' (vLLM <= 0.28)" in run.stdout and "engine 0" in run.stdout


def test_kvobs_message_in_the_log_and_its_directory(logs: dict[str, Path]) -> None:
    run = explain(str(logs["kvobs"]), "--dir", str(logs["dir"]))
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "kvobs (in the log): cause evicted_after_lookup, req_id 'req-victim'" in out
    assert "evidence: lookup reported HIT" in out
    assert "kvobs failure report" in out and "(engine dp0, " in out
    assert "key 0000000000000000/0 end_token 48: evicted_after_lookup" in out
    assert "on dp0: capacity, path=store, req_id='req-writer', resident" in out  # the journaled removal


def test_bare_log_matched_to_kvobs_data_by_key(logs: dict[str, Path]) -> None:
    """A log without kvobs's message (e.g. from before kvobs was enabled) still finds its records."""
    run = explain(str(logs["bare"]), "--dir", str(logs["dir"]), "--json")
    assert run.returncode == 0, run.stderr
    [result] = json.loads(run.stdout)
    [entry] = result["assertions"]
    assert entry["key"] == "0000000000000000/0" and entry["kvobs_cause"] is None
    assert entry["report_causes"] == ["evicted_after_lookup"]
    assert [(r["reason"], r["path"], r["req_id"]) for r in entry["removals"]] == [("capacity", "store", "req-writer")]


def test_sidecar_url_serves_the_failure_report(logs: dict[str, Path]) -> None:
    sidecar = Sidecar(logs["dir"]).start()
    try:
        run = explain(str(logs["bare"]), "--sidecar", sidecar.url)
    finally:
        sidecar.stop()
    assert run.returncode == 0, run.stderr
    assert "kvobs failure report" in run.stdout and "cause evicted_after_lookup" in run.stdout


def test_sidecar_with_a_bearer_token_is_read_with_token_file(logs: dict[str, Path], tmp_path: Path) -> None:
    """A sidecar run with --token-file (its /api/v1/failures answers 401 without the token): explain
    sends the token of its own --token-file (kvobs serve's semantics: one token, a trailing newline
    ignored; a missing or empty file is a usage error), and without it says which option it needs."""
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")  # as a mounted Secret may end in a newline
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token")
    empty = tmp_path / "empty"
    empty.write_text("")
    sidecar = Sidecar(logs["dir"], "--token-file", str(token_file)).start()
    try:
        bare = str(logs["bare"])
        with_token = explain(bare, "--sidecar", sidecar.url, "--token-file", str(token_file))
        without = explain(bare, "--sidecar", sidecar.url)
        wrong_token = explain(bare, "--sidecar", sidecar.url, "--token-file", str(wrong))
        missing = explain(bare, "--sidecar", sidecar.url, "--token-file", str(tmp_path / "nope"))
        blank = explain(bare, "--sidecar", sidecar.url, "--token-file", str(empty))
        no_sidecar = explain(bare, "--dir", str(logs["dir"]), "--token-file", str(token_file))
    finally:
        sidecar.stop()
    assert with_token.returncode == 0, with_token.stderr
    assert "kvobs failure report" in with_token.stdout and "cause evicted_after_lookup" in with_token.stdout
    for run in (without, wrong_token):
        assert run.returncode == 2 and "401" in run.stderr and "--token-file" in run.stderr, run.stderr
    assert missing.returncode == 2 and "cannot read the token file" in missing.stderr, missing.stderr
    assert blank.returncode == 2 and "token file" in blank.stderr, blank.stderr
    assert no_sidecar.returncode == 2 and "--token-file needs --sidecar" in no_sidecar.stderr, no_sidecar.stderr


def test_standard_input_and_no_assertion(logs: dict[str, Path]) -> None:
    run = explain("-", stdin=logs["bare"].read_bytes())
    assert run.returncode == 0 and "1 offload assertion in standard input" in run.stdout
    run = explain("-", stdin=b"INFO all good\n\x00\xff\xfe binary junk \x1b[31m\n")
    assert run.returncode == 1 and "no offload assertion found in standard input" in run.stdout
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["/nonexistent/vllm.log"], "kvobs explain: cannot read /nonexistent/vllm.log: No such file or directory"),
        (["--dir", "/nonexistent/kvobs"], "--dir /nonexistent/kvobs: not a directory"),
        (["--sidecar", "ftp://x"], "--sidecar ftp://x: expected an http:// or https:// URL"),
        (["--sidecar", "http://127.0.0.1:{port}"], "cannot read http://127.0.0.1:"),
    ],
)
def test_bad_input_gets_a_clear_error(logs: dict[str, Path], args: list[str], message: str) -> None:
    args = [a.format(port=free_port()) for a in args]
    if args[0].startswith("--"):
        args.append(str(logs["bare"]))
    run = explain(*args)
    assert run.returncode == 2 and message in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=st.binary(max_size=300), cut=st.integers(0, 1200), as_json=st.booleans())
def test_damaged_log_with_kvobs_data_never_tracebacks(logs: dict[str, Path], junk: bytes, cut: int,
                                                      as_json: bool) -> None:
    """The real kvobs log line, cut anywhere and followed by arbitrary bytes, through the whole
    command (--dir with real reports and journals, text and --json): exit 0 or 1, never an
    exception; and while the line is intact up to the end of vLLM's text, it is still found."""
    line = next(b for b in logs["kvobs"].read_bytes().splitlines() if b"AssertionError: Chunk b'" in b)
    vllm_end = line.index(b" not found in cache") + len(b" not found in cache")
    with tempfile.TemporaryDirectory() as scratch:
        damaged = Path(scratch) / "damaged.log"
        damaged.write_bytes(line[:cut] + junk + b"\n")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            status = cli.main(["explain", "--dir", str(logs["dir"]), *(["--json"] if as_json else []), str(damaged)])
    assert status in (0, 1)
    if as_json:
        [result] = json.loads(out.getvalue())
        found = result["assertions"]
    else:
        found = [] if out.getvalue().startswith("no offload assertion") else [out.getvalue()]
    if cut >= vllm_end and not junk[:1].isalnum():
        assert found and status == 0, out.getvalue()[:2000]


@pytest.mark.parametrize("group", ["9" * 5000, "9" * 30, str(2**32), "-1"],
                         ids=["5000 digits", "30 digits", "2**32", "negative"])
def test_a_logged_group_out_of_range_is_unreadable_not_a_traceback(logs: dict[str, Path], tmp_path: Path,
                                                                  group: str) -> None:
    """kvobs's ``(group=N, ...)`` in the log, with N no KV-cache group can be (a key holds it in 4
    bytes): the group is unreadable like any other damaged field, the rest of kvobs's message is
    still read, and nothing is raised (int() of over 4,300 digits raises ValueError)."""
    text = logs["kvobs"].read_text()
    assert "(group=0, " in text
    log = tmp_path / "group.log"
    log.write_text(text.replace("(group=0, ", f"(group={group}, "))
    for mode in ([], ["--json"]):
        run = explain(str(log), "--dir", str(logs["dir"]), *mode)
        assert run.returncode == 0 and run.stderr == "", run.stderr[-2000:]
    [result] = json.loads(run.stdout)
    [entry] = result["assertions"]
    assert (entry["kvobs_cause"], entry["kvobs_req_id"]) == ("evicted_after_lookup", "req-victim")
    scan = scan_log(io.BytesIO(log.read_bytes()))
    assert [e.kvobs_group for e in scan.assertions] == [None]


# -- logs as they are shipped ----------------------------------------------------------------


def docker_json_file(text: bytes) -> bytes:
    """Docker's json-file log driver: one JSON object per line, the line (with its newline) in ``log``.
    Written here from the real log: there is no Docker engine on this machine."""
    return b"".join(json.dumps({"log": line.decode(errors="replace") + "\n", "stream": "stderr",
                                "time": "2026-11-30T10:00:00.000000000Z"}).encode() + b"\n"
                    for line in text.splitlines())


def loki_jsonl(text: bytes) -> bytes:
    """``logcli query --output=jsonl``: labels, timestamp and the line, one object per line."""
    return b"".join(json.dumps({"labels": {"app": "vllm", "pod": "vllm-0"}, "line": line.decode(errors="replace"),
                                "timestamp": "2026-11-30T10:00:00Z"}).encode() + b"\n"
                    for line in text.splitlines())


def elasticsearch_export(text: bytes) -> bytes:
    """A search response saved as pretty-printed JSON: one document per log line, ``_source.message``."""
    hits = [{"_index": "logs-vllm", "_id": str(n), "_source": {"message": line.decode(errors="replace"),
                                                                 "kubernetes": {"container": "vllm"}}}
            for n, line in enumerate(text.splitlines())]
    return json.dumps({"took": 3, "hits": {"total": {"value": len(hits)}, "hits": hits}}, indent=2).encode()


SHIPPED: dict[str, Any] = {
    "crlf": lambda text: text.replace(b"\n", b"\r\n"),
    "gzip": gzip.compress,
    "docker json-file": docker_json_file,
    "docker json-file, gzip": lambda text: gzip.compress(docker_json_file(text)),
    "loki jsonl": loki_jsonl,
    "elasticsearch export": elasticsearch_export,
}
SAME = ("key", "state", "wording", "vllm_message", "kvobs_cause", "kvobs_req_id", "report_causes", "removals")


@pytest.fixture(scope="module")
def quoted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """vLLM's JSON formatter, and a key whose repr uses double quotes, each with its own kvobs data."""
    base = tmp_path_factory.mktemp("quoted")
    made = {}
    for name, env in {"text": {}, "json": {"CRASH_LOG_FORMATTER": "json"},
                      "quote": {"CRASH_LOG_QUOTE_KEY": "1"}, "quote json": {"CRASH_LOG_QUOTE_KEY": "1",
                                                                             "CRASH_LOG_FORMATTER": "json"}}.items():
        directory = base / name.replace(" ", "-")
        run = subprocess.run([sys.executable, "-m", CRASH_LOG, "kvobs", "missing", "0", str(directory)],
                             cwd=ROOT, capture_output=True, text=True, timeout=120, env=os.environ | env)
        assert run.returncode == 0 and "not found in cache" in run.stdout, run.stderr[-2000:]
        made[name] = directory.with_suffix(".log")
        made[name].write_text(run.stdout)
    return made


def explained(log: Path, directory: Path) -> list[dict[str, Any]]:
    run = explain(str(log), "--dir", str(directory), "--json")
    assert run.returncode == 0, (run.stdout, run.stderr)
    [result] = json.loads(run.stdout)
    return [{field: entry[field] for field in SAME} | {"removals": [(r["key"], r["engine"], r["reason"], r["path"],
                                                                     r["req_id"]) for r in entry["removals"]]}
            for entry in result["assertions"]]


def test_vllms_json_formatter_reads_as_its_text_log(quoted: dict[str, Path]) -> None:
    """vLLM's own ``--logging-config.formatter json`` (python-json-logger): the traceback is in the
    JSON-escaped ``exc_info``; the keys, causes and matched records are those of the text log (each
    run has its own kvobs directory: removals compare by key, engine, reason, path and request)."""
    for text, as_json in (("text", "json"), ("quote", "quote json")):
        want = explained(quoted[text], quoted[text].with_suffix(""))
        assert len(want) == 1 and want[0]["kvobs_cause"] == "evicted_after_lookup" and want[0]["removals"]
        assert b'"exc_info": "Traceback' in quoted[as_json].read_bytes()
        assert explained(quoted[as_json], quoted[as_json].with_suffix("")) == want


def assert_reads_as_the_text_log(log: Path, transform: Callable[[bytes], bytes], tmp_path: Path) -> None:
    """``transform`` of the log explains as the log itself: same keys, causes, reports and removals."""
    directory = log.with_suffix("")
    want = explained(log, directory)
    assert want and want[0]["kvobs_cause"] == "evicted_after_lookup"
    shipped = tmp_path / "shipped.log"
    shipped.write_bytes(transform(log.read_bytes()))
    assert explained(shipped, directory) == want


@pytest.mark.parametrize("log", ["text", "json", "quote", "quote json"])
@pytest.mark.parametrize("shipping", SHIPPED)
def test_logs_as_they_are_shipped_read_as_the_text_log(quoted: dict[str, Path], log: str, shipping: str,
                                                       tmp_path: Path) -> None:
    """CRLF, gzip, Docker's json-file, Loki and Elasticsearch exports, of the text log and of vLLM's
    JSON formatter's, with keys whose repr uses single or double quotes: same keys, same causes
    (kvobs's own, read from its message), same reports and removals."""
    assert_reads_as_the_text_log(quoted[log], SHIPPED[shipping], tmp_path)


def test_an_assertion_logged_twice_is_one_assertion_not_shown(tmp_path: Path) -> None:
    """vLLM logs the traceback from two processes: past the assertions shown, each distinct one
    is counted once, however often it is logged."""
    from kvobs.explain import MAX_ASSERTIONS

    lines = [f"AssertionError: Chunk {n.to_bytes(36, 'big')!r} not found in cache" for n in range(MAX_ASSERTIONS + 3)]
    log = tmp_path / "twice.log"
    log.write_text("\n".join(lines + lines) + "\n")
    run = explain(str(log), "--json")
    [result] = json.loads(run.stdout)
    assert len(result["assertions"]) == MAX_ASSERTIONS and result["not_shown"] == 3
    assert {entry["occurrences"] for entry in result["assertions"]} == {2}
    assert "3 more distinct assertions not shown" in explain(str(log)).stdout


def test_a_cut_gzip_log_keeps_what_was_read_and_says_so(logs: dict[str, Path], tmp_path: Path) -> None:
    """A rotated log copied while being compressed: the assertions before the cut are explained,
    and the output says the input is damaged."""
    text = logs["kvobs"].read_bytes()
    packed = gzip.compress(text + b"x" * 200_000 + b"\n", compresslevel=1)
    cut = tmp_path / "vllm.log.1.gz"
    cut.write_bytes(packed[: len(packed) - 200])
    run = explain(str(cut), "--dir", str(logs["dir"]))
    assert run.returncode == 0, run.stderr
    assert "cause evicted_after_lookup" in run.stdout and "compressed input damaged" in run.stdout
    assert "Traceback" not in run.stderr


# -- logs in the encodings and with the escapes people have (issue 21) -------------------------------


def _coloured(text: bytes) -> bytes:
    """Escapes a colouring viewer or ``tput`` leaves: SGR, ``tput sgr0``'s charset reset ``ESC(B``, an
    OSC 8 hyperlink and an OSC window title, around and inside the assertion's words."""
    out = []
    for line in text.splitlines():
        line = line.replace(b"AssertionError", b"\x1b[1;31mAssertionError\x1b(B\x1b[m")
        line = line.replace(b"Chunk ", b"\x1b]8;;https://example.com/chunk\x1b\\Chunk\x1b]8;;\x1b\\ ")
        line = line.replace(b" not found", b"\x1b(0\x1b(B not\x1b[0m found")
        out.append(b"\x1b]0;vllm serve\x07" + line + b"\x1b(B\x1b[m")
    return b"\n".join(out) + b"\n"


def _shifted(text: bytes) -> bytes:
    """``tput sgr0`` under TERM=screen, tmux-256color or linux: ``ESC[m`` then SI (shift in, 0x0f),
    here after a highlighted key; an SO/SI charset shift, a BEL and a stray ESC too."""
    out = []
    for line in text.splitlines():
        line = line.replace(b"AssertionError", b"\x1b[1;31mAssertionError\x1b[m\x0f")
        line = line.replace(b"Chunk b", b"Chunk \x1b[1mb").replace(b" not found", b"\x1b[m\x0f not\x0e\x0f found")
        out.append(b"\x07" + line + b"\x1b[m\x0f\x1b")
    return b"\n".join(out) + b"\n"


def _c1(encode: Callable[[str], bytes]) -> Callable[[bytes], bytes]:
    """8-bit C1 controls, ``encode``d: CSI (U+009B) with its parameters, an OSC title to ST (U+009C),
    a DCS string, IND (U+0084) and SS3 (U+008F)."""
    def transform(text: bytes) -> bytes:
        out = []
        for line in text.splitlines():
            line = line.replace(b"AssertionError", encode("\x9b1;31mAssertionError\x9bm\x84"))
            line = line.replace(b" not found", encode("\x90q#0;2;0;0;0\x9c not\x8f found"))
            out.append(encode("\x9d0;vllm serve\x9c") + line + encode("\x9b0m"))
        return b"\n".join(out) + b"\n"
    return transform


def _strings(text: bytes) -> bytes:
    """DCS, SOS, PM and APC strings to ST (``ESC P`` / ``ESC X`` / ``ESC ^`` / ``ESC _`` ... ``ESC \\``), a BEL
    inside an APC (only ST ends one), and tmux's passthrough of an OSC title (a DCS whose ESCs are doubled)."""
    out = []
    for line in text.splitlines():
        line = line.replace(b"AssertionError", b"\x1bP1$r0m\x1b\\AssertionError\x1bXsos\x1b\\")
        line = line.replace(b" not found", b"\x1b^pm\x1b\\ not\x1b_Ga=T;\x07AAAA\x1b\\ found")
        out.append(b"\x1bPtmux;\x1b\x1b]0;vllm serve\x07\x1b\\" + line)
    return b"\n".join(out) + b"\n"


def _utf16_powershell(text: bytes) -> bytes:
    """What Windows PowerShell's ``>`` writes: UTF-16 LE with a BOM, CRLF."""
    return codecs.BOM_UTF16_LE + text.decode().replace("\n", "\r\n").encode("utf-16-le")


OTHER_FORMS: dict[str, Any] = {
    "utf-16 le bom, crlf (PowerShell >)": _utf16_powershell,
    "utf-16 be bom": lambda text: codecs.BOM_UTF16_BE + text.decode().encode("utf-16-be"),
    "utf-16 le, no bom": lambda text: text.decode().encode("utf-16-le"),
    "utf-32 bom": lambda text: text.decode().encode("utf-32"),
    "utf-8 bom": lambda text: codecs.BOM_UTF8 + text,
    "xz": lzma.compress,
    "bz2": bz2.compress,
    "xz of utf-16": lambda text: lzma.compress(_utf16_powershell(text)),
    "escapes beyond CSI": _coloured,
    "gzip of escapes": lambda text: gzip.compress(_coloured(text)),
    "SI after sgr0 (screen, tmux, linux), C0 controls": _shifted,
    "8-bit C1 as raw bytes (not UTF-8: latin-1)": _c1(lambda text: text.encode("latin-1")),
    "8-bit C1 as UTF-8 code points": _c1(lambda text: text.encode("utf-8")),
    "DCS, SOS, PM, APC strings": _strings,
}


@pytest.mark.parametrize("log", ["text", "json"])
@pytest.mark.parametrize("form", OTHER_FORMS)
def test_logs_in_other_encodings_compressions_and_escapes_read_as_the_text_log(
        quoted: dict[str, Path], log: str, form: str, tmp_path: Path) -> None:
    """Decoded by content (BOM, magic bytes, NUL pattern), escapes of every ECMA-48 form removed:
    the same keys, causes, reports and removals as the plain log."""
    assert_reads_as_the_text_log(quoted[log], OTHER_FORMS[form], tmp_path)


@pytest.mark.parametrize(("data", "named"), [
    (b"\x28\xb5\x2f\xfd" + b"\0" * 64, "zstd"),
    (b"\x04\x22\x4d\x18" + b"\0" * 64, "lz4"),
    (b"PK\x03\x04" + b"\0" * 64, "zip"),
])
def test_a_log_kvobs_cannot_decode_is_said_so_and_why(tmp_path: Path, data: bytes, named: str) -> None:
    log = tmp_path / "vllm.log.1"
    log.write_bytes(data)
    run = explain(str(log))
    assert run.returncode == 2 and named in run.stderr and "no offload assertion" not in run.stdout, run
    assert "Traceback" not in run.stderr


# -- --sidecar follows the API's paging, bounded (issue 21) ----------------------------------------


def with_other_reports(logs: dict[str, Path], tmp_path: Path, *, newer: bool) -> Path:
    """A copy of the logged run's directory plus 1,000 reports of other keys, all newer or all older
    than the logged failure's: it lands on the API's second page of 1,000, or stays on the first."""
    directory = tmp_path / "kvobs"
    shutil.copytree(logs["dir"], directory)
    [real] = sorted((directory / "failures").glob("*.json"))
    report = json.loads(real.read_text())
    for n in range(1000):
        other = {**report, "vllm_message": f"Chunk b'other{n}' not found in cache", "missing": [],
                 "time": report["time"] + (1 + n if newer else -1 - n)}
        (directory / "failures" / f"{int(other['time'] * 1000):015d}-dp0-1-{n}.json").write_text(json.dumps(other))
    return directory


def test_sidecar_reports_on_a_later_page_are_found(logs: dict[str, Path], tmp_path: Path) -> None:
    """1,001 reports: the logged failure's is the oldest, on the API's second page of 1,000."""
    directory = with_other_reports(logs, tmp_path, newer=True)
    sidecar = Sidecar(directory).start()
    try:
        run = explain(str(logs["bare"]), "--sidecar", sidecar.url, "--json")
    finally:
        sidecar.stop()
    assert run.returncode == 0, run.stderr
    [result] = json.loads(run.stdout)
    assert result["assertions"][0]["report_causes"] == ["evicted_after_lookup"] and result["damage"] == []


class _EndlessPages(BaseHTTPRequestHandler):
    """A sidecar whose ``next`` never ends (a huge or misbehaving one)."""

    def do_GET(self) -> None:
        body = json.dumps({"failures": [], "next": "/api/v1/failures?limit=1000&before=000000000000001-0-1-0"})
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, format: str, *args: Any) -> None:
        return


def test_sidecar_paging_is_bounded_and_says_where_it_stopped(logs: dict[str, Path]) -> None:
    from kvobs.explain_evidence import MAX_SIDECAR_PAGES

    server = ThreadingHTTPServer(("127.0.0.1", 0), _EndlessPages)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        run = explain(str(logs["bare"]), "--sidecar", f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()
    assert run.returncode == 0, run.stderr
    assert f"--sidecar: stopped after {MAX_SIDECAR_PAGES} pages" in run.stdout, run.stdout


def _failing_after_one_page(upstream: str, failure: str) -> type[BaseHTTPRequestHandler]:
    """A proxy that serves the first page from a real ``kvobs serve`` and fails every later one as
    ``failure`` says: the connection closed unanswered, a page that is not JSON, a page over the read cap."""
    from kvobs.explain_evidence import MAX_SIDECAR_PAGE_BYTES

    class Proxy(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if "before=" not in self.path:  # the first page
                with urllib.request.urlopen(upstream + self.path, timeout=10) as response:
                    body = response.read()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            elif failure == "closed":
                self.close_connection = True  # no status line: the client sees the connection end
            elif failure == "not json":
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"<html>502 Bad Gateway</html>")
            else:  # too large: no Content-Length, more bytes than explain reads of a page
                self.send_response(200)
                self.end_headers()
                chunk = b" " * 2**20
                with contextlib.suppress(OSError):  # explain stops reading at its cap
                    for _ in range(MAX_SIDECAR_PAGE_BYTES // len(chunk) + 1):
                        self.wfile.write(chunk)

        def log_message(self, format: str, *args: Any) -> None:
            return

    return Proxy


@pytest.mark.parametrize(("failure", "why"), [
    ("closed", "cannot read"),
    ("not json", "did not answer with kvobs failure reports"),
    ("too large", "too large for one page"),
])
def test_sidecar_paging_that_fails_part_way_keeps_what_it_found_and_says_why(
        logs: dict[str, Path], tmp_path: Path, failure: str, why: str) -> None:
    """1,001 reports in a real ``kvobs serve``: the logged failure's is the newest, on page 1; page 2
    fails. The report found on page 1 is kept, and the output says where and why paging stopped."""
    directory = with_other_reports(logs, tmp_path, newer=False)
    sidecar = Sidecar(directory).start()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _failing_after_one_page(sidecar.url, failure))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        runs = [explain(str(logs["bare"]), "--sidecar", url, *mode) for mode in ([], ["--json"])]
    finally:
        server.shutdown()
        server.server_close()
        sidecar.stop()
    for run in runs:
        assert run.returncode == 0 and "Traceback" not in run.stderr, (run.stdout, run.stderr)
    assert "cause evicted_after_lookup" in runs[0].stdout
    assert "--sidecar: stopped after 1 page (1000 reports): " in runs[0].stdout, runs[0].stdout
    [result] = json.loads(runs[1].stdout)
    assert result["assertions"][0]["report_causes"] == ["evicted_after_lookup"]
    [note] = result["damage"]
    assert why in note and f"{url}/api/v1/failures?" in note and "older reports were not read" in note, note
