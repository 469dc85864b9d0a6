"""An engine restarted with the same pid (a restarted container: same pid namespace layout).

The new EngineCore writes the same journal file name and its cumulative totals start from
zero again. The sidecar's counters must keep the first process's counts (they are counters),
not fall back to the new process's. Reproduced for real: two engines one after the other in
this process (same pid, same engine name, same directory), each through kvobs's own journal.
"""

from __future__ import annotations

import time
from pathlib import Path

from kvobs.journal import FLUSH_EVERY_S
from tests.support.faults import churn, engine_totals, observed_cpu


def test_sidecar_totals_survive_an_engine_restart_with_the_same_pid(tmp_path: Path) -> None:
    directory = tmp_path / "kvobs"
    first = observed_cpu(dir=str(directory), engine="e0")
    churn(first, 5)  # 4 rounds evict 4 chunks each
    first.shutdown()
    first_evicted = first.observer.evicted["capacity"]
    second = observed_cpu(dir=str(directory), engine="e0")  # the restarted engine
    churn(second, 3, start=100)  # 2 rounds evict 4 each
    second.shutdown()
    second_evicted = second.observer.evicted["capacity"]
    assert (first_evicted, second_evicted) == (16, 8)
    totals = engine_totals(directory, "e0")
    assert totals["evicted"]["capacity"] == first_evicted + second_evicted
    assert totals["batches"]["capacity"] == first.observer.batches["capacity"] + second.observer.batches["capacity"]


def test_sidecar_totals_of_two_observed_managers_sharing_a_process_and_engine_name(tmp_path: Path) -> None:
    """Two managers observed at once in one process under one engine name (e.g. the default
    ``"0"`` label for both): each writer's cumulative totals count, neither replaces the other."""
    directory = tmp_path / "kvobs"
    first = observed_cpu(dir=str(directory), engine="e0")
    time.sleep(FLUSH_EVERY_S * 3)  # the first writer's hello and totals are out before the second starts
    second = observed_cpu(dir=str(directory), engine="e0")
    try:
        churn(first, 5)
        churn(second, 3, start=100)
        time.sleep(FLUSH_EVERY_S * 3)  # both writers' totals interleave in the journal
        churn(first, 2, start=200)
    finally:
        first.shutdown()
        second.shutdown()
    want = first.observer.evicted["capacity"] + second.observer.evicted["capacity"]
    assert want == 6 * 4 + 2 * 4
    assert engine_totals(directory, "e0")["evicted"]["capacity"] == want
