"""``kvobs explain`` keeps different failures on one key apart (issue 31, class 6).

Two engines in survive mode (tests/support/survive_log.py: real managers through the plugin, vLLM's
own logging), one kvobs directory, each surviving two loads of the same key for different requests
and causes; their logs interleaved as a log collector merges them. Each failure is its own assertion,
with its own request, cause, report and its engine's removals, read from the directory or the sidecar.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.services import ROOT, Sidecar

pytestmark = pytest.mark.slow

FAILURES = {  # (engine, request) -> cause
    ("0", "req-a-dp0"): "evicted_after_lookup",
    ("0", "req-b-dp0"): "coverage_mismatch",
    ("1", "req-a-dp1"): "evicted_after_lookup",
    ("1", "req-b-dp1"): "coverage_mismatch",
}


@pytest.fixture(scope="module")
def merged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The interleaved log of both engines, and their kvobs directory."""
    base = tmp_path_factory.mktemp("merged")
    directory = base / "kvobs"
    logs = []
    for dp in (0, 1):
        run = subprocess.run([sys.executable, "-m", "tests.support.survive_log", str(dp), str(directory)], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        logs.append(run.stdout.splitlines())
    assert all(len(lines) == 2 for lines in logs), logs  # one warning line per survived load
    log = base / "merged.log"
    log.write_text("".join(f"{a}\n{b}\n" for a, b in zip(*logs, strict=True)))
    return log, directory


def _explained(*args: str) -> list[dict[str, Any]]:
    run = subprocess.run([sys.executable, "-m", "kvobs.cli", "explain", "--json", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    [result] = json.loads(run.stdout)
    return result["assertions"]


def test_each_failure_on_a_shared_key_is_its_own_assertion_with_its_own_report(merged: tuple[Path, Path]) -> None:
    log, directory = merged
    assertions = _explained(str(log), "--dir", str(directory))
    assert {(a["engine"], a["kvobs_req_id"]): a["kvobs_cause"] for a in assertions} == FAILURES
    assert len({a["key"] for a in assertions}) == 1 and all(a["occurrences"] == 1 for a in assertions)
    for a in assertions:
        assert a["report_causes"] == [a["kvobs_cause"]], a  # its own report, not the key's others
        assert a["removals"] and {r["engine"] for r in a["removals"]} == {a["engine"]}, a


def test_the_sidecars_reports_are_matched_the_same_way(merged: tuple[Path, Path]) -> None:
    log, directory = merged
    sidecar = Sidecar(directory).start()
    try:
        assertions = _explained(str(log), "--sidecar", sidecar.url)
    finally:
        sidecar.stop()
    assert {(a["engine"], a["kvobs_req_id"]): tuple(a["report_causes"]) for a in assertions} == {
        failure: (cause,) for failure, cause in FAILURES.items()}


def test_the_same_failure_logged_again_is_counted_not_repeated(merged: tuple[Path, Path], tmp_path: Path) -> None:
    """Re-logged by a process of no engine (the API server), or cut before kvobs's message: counted with
    the failure it repeats, not a failure of its own."""
    log, _ = merged
    lines = log.read_text().splitlines()
    dp0_first, dp1_first = lines[0], lines[1]  # req-a-dp0's and req-a-dp1's
    again = [
        "(APIServer pid=7) ERROR " + dp0_first.split(") ", 1)[1],
        dp1_first.split(" (group=", 1)[0],  # vLLM's text alone, kvobs's message cut off
    ]
    relogged = tmp_path / "relogged.log"
    relogged.write_text("\n".join(lines + again) + "\n")
    assertions = _explained(str(relogged))
    assert {(a["engine"], a["kvobs_req_id"]): a["occurrences"] for a in assertions} == {
        ("0", "req-a-dp0"): 2, ("0", "req-b-dp0"): 1, ("1", "req-a-dp1"): 2, ("1", "req-b-dp1"): 1}
