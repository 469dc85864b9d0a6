"""The fuzz targets (tests/fuzz/fuzz_<target>.py) as tests: every committed corpus file and regression input
(tests/fuzz/crashes/<target>/) through its target, and each target under atheris for a short, bounded time
(``KVOBS_FUZZ_SECONDS``, default 10 s per target) in a process of its own. ``make fuzz`` runs them longer."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fuzz.run import HERE, ROOT, TARGETS

INPUT_TIMEOUT_S = 10.0
"""What one input may take in-process (the fuzzer's own bound is ``run.py --input-timeout``, the same)."""

def _inputs() -> list[object]:
    params: list[object] = []
    for target in TARGETS:
        for kind in ("corpus", "crashes"):
            folder = HERE / kind / target
            for path in sorted(folder.iterdir()) if folder.is_dir() else ():
                params.append(pytest.param(target, path, id=f"{kind}/{target}/{path.name}"))
    return params


def test_every_target_has_seeds_built_from_real_outputs() -> None:
    for target in TARGETS:
        assert list((HERE / "corpus" / target).iterdir()), f"tests/fuzz/corpus/{target}/ is empty"


@pytest.mark.parametrize(("target", "path"), _inputs())
def test_a_committed_input_keeps_to_its_targets_contract(target: str, path: Path) -> None:
    run = importlib.import_module(f"tests.fuzz.fuzz_{target}").TestOneInput
    start = time.monotonic()
    run(path.read_bytes())  # an exception outside the target's contract fails the test
    assert time.monotonic() - start < INPUT_TIMEOUT_S, f"{path} took {time.monotonic() - start:.1f} s"


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
def test_a_short_fuzz_run_finds_no_crash(target: str, tmp_path: Path) -> None:
    pytest.importorskip("atheris")
    seconds = int(os.environ.get("KVOBS_FUZZ_SECONDS", "10"))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.fuzz.run", "--seconds", str(seconds), "--work", str(tmp_path / "work"),
         "--crashes", str(tmp_path / "crashes"), "--input-timeout", str(int(INPUT_TIMEOUT_S)), target],
        cwd=ROOT, capture_output=True, text=True, timeout=seconds + 120, check=False,
    )
    found = sorted((tmp_path / "crashes" / target).iterdir())
    assert proc.returncode == 0 and not found, (
        f"fuzz target {target} crashed (exit {proc.returncode}); keep the input as a regression input: copy "
        f"{[str(p) for p in found]} into tests/fuzz/crashes/{target}/\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
