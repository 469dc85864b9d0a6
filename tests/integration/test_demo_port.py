"""`kvobs demo` must not report against somebody else's sidecar (e.g. the compose stack's on 9464)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from services import ROOT, Sidecar


def test_demo_refuses_a_port_another_sidecar_already_serves(tmp_path: Path) -> None:
    other = Sidecar(tmp_path / "other").start()  # a real sidecar reading another directory
    try:
        run = subprocess.run(
            [sys.executable, "-m", "kvobs.cli", "demo", "--requests", "5", "--no-tiering",
             "--dir", str(tmp_path / "demo"), "--port", str(other.port)],
            cwd=ROOT, capture_output=True, text=True, timeout=300,
        )
    finally:
        other.stop()
    # Before: the demo's own sidecar died on the bound port, /healthz of the other one answered,
    # and the summary compared the engines with a sidecar that never read the demo's directory.
    assert run.returncode != 0, run.stdout
    assert "summary" not in run.stdout and "DISAGREES" not in run.stdout
    assert f"port {other.port}" in run.stderr and "in use" in run.stderr, run.stderr
