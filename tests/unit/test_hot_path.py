"""Which form of the hot path runs, and that an operator can tell.

`make test` builds kvobs with its compiled hot path: the suite fails if the build silently fell
back to the Python form (it runs the hot-path tests again with KVOBS_PURE_PYTHON=1 on purpose).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import kvobs
from kvobs import hot_path_loader
from kvobs.journal import JournalSink
from kvobs.options import Options
from kvobs.sidecar.ingest import Ingest
from kvobs.sidecar.metrics import KvobsCollector

PACKAGE = Path(kvobs.__file__).parent


def test_the_compiled_form_runs_unless_python_is_asked_for() -> None:
    forced = os.environ.get("KVOBS_PURE_PYTHON", "") not in ("", "0")
    assert ("python" if forced else "compiled") == hot_path_loader.HOT_PATH
    assert hot_path_loader.is_compiled(hot_path_loader._impl) is not forced


def test_without_the_compiled_form_kvobs_runs_the_source_and_says_so_once(tmp_path: Path) -> None:
    shutil.copytree(PACKAGE, tmp_path / "kvobs", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    probe = ("import logging; logging.basicConfig(level=logging.WARNING);"
             "import kvobs.hot_path_loader as r, kvobs.hot_path_loader; print(r.HOT_PATH)")
    env = {k: v for k, v in os.environ.items() if k != "KVOBS_PURE_PYTHON"} | {"PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "python"
    assert out.stderr.count("the compiled hot path is not built") == 1, out.stderr


def test_build_info_says_which_form_each_engine_runs(tmp_path: Path) -> None:
    sink = JournalSink(tmp_path, Options(engine="dp0"), "0.33.0")
    sink.close()
    ingest = Ingest(tmp_path)
    ingest.poll()
    [build] = [m for m in KvobsCollector(ingest).collect() if m.name == "kvobs_build_info"]
    [sample] = build.samples
    assert sample.labels["hot_path"] == hot_path_loader.HOT_PATH and sample.labels["vllm_version"] == "0.33.0"
