"""benchmarks/engine.py's attribution runs in a real engine of each release: its timers reach kvobs's
taps and the vLLM code they wrap, and the journal's writer thread is found. Not a timing test (the
figures are docs/performance.md's, from ``make bench-engine``): it fails when the benchmark no longer
measures what it says, e.g. after a change to ``kvobs.vllm.manager._taps`` or ``compat.hook_policy``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_engine_benchmark_attributes_kvobs_time_in_a_real_engine(engine_python: Path, tmp_path: Path) -> None:
    out = tmp_path / "attribution.json"
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.engine", "--engine-python", str(engine_python), "--attribute",
         "--quick", "--runs", "1", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"kvobs", "kvobs+journal"}
    for side, (result,) in results.items():
        assert result["timed_calls_per_step"] > 1, (side, result)  # the manager's taps, timed
        assert 0 < result["kvobs_share_of_scheduler"] < 0.5, (side, result)
        assert result["work_external_kv_transfer"] > 0, (side, result)  # loads from the CPU tier happened
    (plain,), (journal,) = results["kvobs"], results["kvobs+journal"]
    assert plain["journal_cpu_s"] == 0  # no journal: no writer thread
    assert journal["journal_cpu_s"] > 0, journal  # its writer thread, found
    assert plain["applier_cpu_s"] > 0, plain  # kvobs's applier thread (kvobs/applier.py), found
