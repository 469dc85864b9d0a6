"""The sidecar remembers which failure reports it folded (so it neither counts nor logs one twice) only
for as long as the report exists: the engines prune their reports (``max_reports``), and a report's name
(ms time, engine, pid, sequence) never comes back, so the memory stays as bounded as the directory."""

from __future__ import annotations

import shutil
from pathlib import Path

from kvobs.sidecar.ingest import Ingest
from kvobs.sidecar.metrics import KvobsCollector

DEMO = Path(__file__).resolve().parents[1] / "fixtures" / "wire" / "v0.1.0" / "demo"


def missing_chunks(ingest: Ingest) -> float:
    return sum(s.value for family in KvobsCollector(ingest).collect() for s in family.samples
               if s.name == "kvobs_missing_chunks_total")


def test_pruned_reports_are_forgotten_and_nothing_is_counted_twice(tmp_path: Path) -> None:
    directory = tmp_path / "kvobs"
    shutil.copytree(DEMO, directory, ignore=shutil.ignore_patterns("sidecar-state.json", "metrics.json"))
    reports = sorted((directory / "failures").glob("*.json"))
    ingest = Ingest(directory)
    ingest.poll()
    counted = missing_chunks(ingest)
    assert len(ingest.state.reports_seen) == len(reports) > 10 and counted > 0
    for path in reports[:10]:  # what an engine's max_reports does
        path.unlink()
    ingest.poll()
    assert len(ingest.state.reports_seen) == len(reports) - 10
    assert missing_chunks(ingest) == counted  # the counters keep what the pruned reports said
    ingest.checkpoint()
    restarted = Ingest(directory)  # from the checkpoint: the remaining reports are not folded again
    restarted.poll()
    assert missing_chunks(restarted) == counted and len(restarted.state.reports_seen) == len(reports) - 10


def test_an_unlistable_failures_directory_forgets_nothing(tmp_path: Path) -> None:
    """A directory it cannot list says nothing about which reports are gone: the memory is kept."""
    directory = tmp_path / "kvobs"
    shutil.copytree(DEMO, directory, ignore=shutil.ignore_patterns("sidecar-state.json", "metrics.json"))
    ingest = Ingest(directory)
    ingest.poll()
    seen = set(ingest.state.reports_seen)
    failures = directory / "failures"
    failures.rename(directory / "aside")  # a file where the directory was: listing it fails (uid-independent)
    failures.write_text("")
    try:
        ingest.poll()
    finally:
        failures.unlink()
        (directory / "aside").rename(failures)
    assert ingest.state.reports_seen == seen
    ingest.poll()  # listed again: nothing was forgotten, nothing is folded twice
    assert ingest.state.reports_seen == seen
