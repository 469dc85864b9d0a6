"""The wall clock stepped back does not cost the newest failure report (issue 31, class 2).

An engine process under libfaketime (tests/support/clock_step_engine.py) fails loads through a real
observed manager with ``max_reports`` reached, then its wall clock steps back a minute (NTP steps
the clock when the offset exceeds 128 ms; a VM restored from a snapshot; an operator's ``date -s``)
and it fails one more. Its report had been named a minute before the others and deleted as the
oldest as it was written: gone from the directory, ``/api/v1/failures`` and ``kvobs explain --dir``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvobs.wire.decode import iter_reports
from tests.support.clock_step_engine import faked_env
from tests.support.services import ROOT, Sidecar, http_get

pytestmark = pytest.mark.slow

MAX_REPORTS = 3


def _run_engine(tmp_path: Path, offsets: list[float]) -> list[tuple[str, float]]:
    """The failures' request ids and the wall time the engine process read at each."""
    clock = tmp_path / "clock"
    clock.write_text("+0\n")
    run = subprocess.run(
        [sys.executable, "-m", "tests.support.clock_step_engine", str(tmp_path / "kvobs"), str(MAX_REPORTS),
         *map(str, offsets)],
        cwd=ROOT, env=faked_env(clock), capture_output=True, text=True, timeout=180,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    failures = [(req, float(when)) for req, when in (line.split() for line in run.stdout.splitlines())]
    assert [req for req, _ in failures] == [f"req-{n}" for n in range(len(offsets))]
    return failures


def test_the_newest_report_survives_a_clock_step_back_and_is_served_first(tmp_path: Path) -> None:
    directory = tmp_path / "kvobs"
    sidecar = Sidecar(directory).start()
    try:
        failures = _run_engine(tmp_path, [0, 0, 0, -60])
        assert failures[3][1] < failures[2][1] - 50  # the engine's wall clock did step back
        kept = [report["req_id"] for report in iter_reports(directory / "failures")]  # newest first
        assert kept == ["req-3", "req-2", "req-1"]  # the oldest pruned, the newest kept
        status, _, body = http_get(f"{sidecar.url}/api/v1/failures")
        assert status == 200
        served = json.loads(body)["failures"]
        assert [r["req_id"] for r in served] == ["req-3", "req-2", "req-1"]
        assert served[0]["time"] == pytest.approx(failures[3][1], abs=5)  # its wall time, stepped back
    finally:
        sidecar.stop()
    explained = subprocess.run(
        [sys.executable, "-m", "kvobs.cli", "explain", "--json", "--dir", str(directory), "-"],
        input="AssertionError: " + served[0]["vllm_message"] + "\n", cwd=ROOT, capture_output=True, text=True,
        timeout=60,
    )
    [result] = json.loads(explained.stdout)
    [entry] = result["assertions"]
    assert entry["reports"] == [served[0]["id"]]


def test_names_follow_the_clock_again_once_it_has_caught_up(tmp_path: Path) -> None:
    """A step forward and back again: the names stay in write order, and the pruned ones are the
    first written."""
    failures = _run_engine(tmp_path, [0, 30, 0, -30, 0])
    kept = [(report["req_id"], report["id"]) for report in iter_reports(tmp_path / "kvobs" / "failures")]
    assert [req for req, _ in kept] == ["req-4", "req-3", "req-2"]
    assert failures[4][1] < failures[1][1]  # req-4's wall time is before req-1's: the names are not


def test_an_engine_restarted_with_its_clock_behind_keeps_its_first_report(tmp_path: Path) -> None:
    """The clock behind when the engine starts again (a VM restored from a snapshot): the new process's
    first report is named after the reports the earlier process left, and kept."""
    _run_engine(tmp_path, [0, 0, 0])
    [(req, _)] = _run_engine(tmp_path, [-120])
    kept = [report["req_id"] for report in iter_reports(tmp_path / "kvobs" / "failures")]
    assert req == "req-0" and kept == ["req-0", "req-2", "req-1"]  # the new process's first, then the earlier's
