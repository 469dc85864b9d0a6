"""`kvobs demo` end to end at a reduced size: both defect classes named, evidence exported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from services import ROOT, free_port


def test_demo_names_both_causes_and_exports_reports(tmp_path: Path) -> None:
    directory = tmp_path / "kvobs"
    run = subprocess.run(
        [sys.executable, "-m", "kvobs.cli", "demo", "--requests", "80", "--dir", str(directory),
         "--port", str(free_port())],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "cause: coverage_mismatch" in out and "cause: evicted_after_lookup" in out
    assert "path=lookup" in out  # the tiering promotion inside lookup()
    assert "evicted chunks by reason: {'capacity':" in out
    assert "near misses (hits evicted before load): 0" not in out
    assert len(list((directory / "failures").glob("*.json"))) >= 2
    assert list((directory / "journal").glob("dp0-*.jsonl")) and list((directory / "journal").glob("dp1-*.jsonl"))
