"""`kvobs demo` must not report against somebody else's sidecar (e.g. the compose stack's on 9464)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.services import ROOT, Sidecar, free_port


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


# Runs ``kvobs demo`` with vLLM made unimportable: what the demo does before it imports vLLM (10-20 s
# of torch and vLLM) is then all it can do, so these show the order without timing anything.
WITHOUT_VLLM = """
import sys

class NoVllm:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("vLLM is made unimportable by the test")
        return None

sys.meta_path.insert(0, NoVllm())
from kvobs.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_demo_checks_its_port_before_loading_vllm(tmp_path: Path) -> None:
    other = Sidecar(tmp_path / "other").start()
    try:
        run = subprocess.run([sys.executable, "-c", WITHOUT_VLLM, "demo", "--no-tiering", "--dir",
                              str(tmp_path / "demo"), "--port", str(other.port)],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    finally:
        other.stop()
    # Before: the port was found taken only after vLLM had loaded (here: an ImportError instead).
    assert run.returncode == 2 and "in use" in run.stderr and "ImportError" not in run.stderr, run.stderr


def test_demo_says_what_it_does_before_loading_vllm(tmp_path: Path) -> None:
    port = free_port()
    run = subprocess.run([sys.executable, "-c", WITHOUT_VLLM, "demo", "--no-tiering", "--dir",
                          str(tmp_path / "demo"), "--port", str(port)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "vLLM is made unimportable by the test" in run.stderr
    # Before: nothing at all was printed until vLLM had loaded.
    first = run.stdout.splitlines()[0]
    assert first.startswith(f"kvobs demo: starting the sidecar on 127.0.0.1:{port} and loading vLLM"), run.stdout
