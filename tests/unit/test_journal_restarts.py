"""Journal files stay bounded across engine restarts (a crash loop is what kvobs is for).

Each process keeps at most KEEP_SEGMENTS segments of its own; segments of earlier processes
of the same engine must not pile up forever either: the newest ``journal_processes`` are kept.
Real processes (distinct pids) write through kvobs's own JournalSink; the sidecar's real ingest polls between them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvobs.options import Options
from kvobs.sidecar.ingest import Ingest

ROOT = Path(__file__).resolve().parents[2]  # the cwd of the processes: ``-c`` puts it first on sys.path (tests.support)
ENGINE_PROCESS = """
import sys
from kvobs.journal import JournalSink
from kvobs.observer import Observer
from kvobs.options import Options
from tests.support.removals import record_removal

observer = Observer(Options(dir=sys.argv[1], engine=sys.argv[2], journal_processes=int(sys.argv[3])))
sink = JournalSink(sys.argv[1], observer.options)
observer.add_sink(sink)
for i in range(3):
    record_removal(observer, [bytes(32) + i.to_bytes(4, "big")], "capacity", "store", "r")
sink.close()
"""


def _pids(journal: Path, engine: str) -> set[str]:
    return {p.name.rsplit(".", 2)[0].rpartition("-")[2] for p in journal.glob(f"{engine}-*.jsonl")}


@pytest.mark.slow
@pytest.mark.parametrize("kept", [Options().journal_processes, 2])
def test_earlier_processes_segments_are_pruned_and_totals_stay_exact(tmp_path: Path, kept: int) -> None:
    directory = tmp_path / "kvobs"
    ingest = Ingest(directory)
    restarts = kept + 4
    for _ in range(restarts):
        for engine in ("e0", "e1"):  # e1 restarts too; e0's pruning must not touch it, nor e1's e0's
            subprocess.run([sys.executable, "-c", ENGINE_PROCESS, str(directory), engine, str(kept)],
                           cwd=ROOT, check=True, timeout=60)
        ingest.poll()  # the sidecar keeps up: every process's totals read before its files go
    journal = directory / "journal"
    for engine in ("e0", "e1"):
        assert len(_pids(journal, engine)) == kept + 1, sorted(p.name for p in journal.iterdir())
        assert ingest.state.engines[("", engine)].totals()["evicted"]["capacity"] == 3 * restarts
