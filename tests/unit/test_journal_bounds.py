"""The kvobs directory's size is bounded by its options (``kvobs.journal.disk_bound``), and the
engine's identity (``model_name``, ``engine``) travels with every record and report."""

from __future__ import annotations

import json
from pathlib import Path

from kvobs.diagnosis import MISSING
from kvobs.journal import KEEP_SEGMENTS, REPORT_BYTES, JournalSink, disk_bound
from kvobs.observer import Observer, Unloadable
from kvobs.options import Options, parse_options
from kvobs.sidecar.ingest import Ingest
from kvobs.sidecar.metrics import KvobsCollector
from kvobs.sidecar.state import SidecarState
from kvobs.wire.decode import read_report
from kvobs.wire.encode import bounded_report
from kvobs.wire.format import MAX_LINE_BYTES
from tests.support.removals import journal_one_removal, record_removal


def _directory_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def test_a_busy_engine_stays_within_its_journal_bound(tmp_path: Path) -> None:
    """Far more records than ``journal_bytes`` holds, flushed in big and small writes: every segment
    stays within its quarter (plus one line), and the process's files within disk_bound."""
    options = Options(engine="0", journal_bytes=2**20)
    observer = Observer(options)
    sink = JournalSink(tmp_path, observer.options)
    observer.add_sink(sink)
    for i in range(40_000):
        record_removal(observer, [i.to_bytes(32, "big") + b"\0\0\0\0"], "capacity", "store", f"request-{i}", [0.5])
        if i % 9_000 == 0:
            sink.flush()
    sink.close()
    segments = sorted((tmp_path / "journal").glob("*.jsonl"))
    assert len(segments) == KEEP_SEGMENTS  # it rolled, and kept only its last four
    assert all(p.stat().st_size <= options.journal_bytes // KEEP_SEGMENTS + MAX_LINE_BYTES for p in segments)
    assert max(p.stat().st_size for p in segments) > options.journal_bytes // KEEP_SEGMENTS // 2
    assert _directory_bytes(tmp_path) <= disk_bound(options)


def test_disk_bound_grows_with_what_is_kept() -> None:
    base = parse_options({"journal_bytes": 32 * 2**20, "journal_processes": 2, "max_reports": 100})
    assert disk_bound(base, engines=2) > disk_bound(base, engines=1) > 32 * 2**20 * 3
    assert disk_bound(parse_options({"journal_processes": 3}), 1) > disk_bound(parse_options({}), 1) / 3


def test_a_huge_report_is_cut_to_its_bound_and_still_read(tmp_path: Path) -> None:
    """A load of 5,000 missing keys with a 100 KB request id: the report fits REPORT_BYTES, says how
    many keys it does not list, keeps every key in its summary, and the sidecar reads it."""
    observer = Observer(Options(engine="3", model_name="meta-llama/Llama-3.1-8B"))
    sink = JournalSink(tmp_path, observer.options)
    observer.add_sink(sink)
    keys = [Unloadable(i.to_bytes(32, "big") + b"\0\0\0\1", 1, None, MISSING) for i in range(5_000)]
    diagnosis = observer.load_failed("Chunk b'x' not found in cache", "r" * 100_000, 5_000, None, keys, 0)
    observer.publish_failure(diagnosis, AssertionError(diagnosis.message))
    sink.close()
    [path] = (tmp_path / "failures").glob("*.json")
    assert path.stat().st_size <= REPORT_BYTES
    report = read_report(path)
    assert (report.engine, report.model_name) == ("3", "meta-llama/Llama-3.1-8B")
    assert report.data["missing_not_listed"] == 5_000 - len(report.data["missing"]) > 0
    assert sum(n for _, _, n in report.summary.counts) == 5_000
    small = {"kind": "failure", "missing": [], "message": "m"}
    assert json.loads(bounded_report(small, REPORT_BYTES)) == small  # what fits is written as is


def test_model_name_and_engine_label_every_series_and_not_the_sidecars(tmp_path: Path) -> None:
    for model, engine in (("llama", "0"), ("llama", "1"), ("mistral", "0")):
        journal_one_removal(tmp_path, engine=engine, model_name=model)
    ingest = Ingest(tmp_path)
    ingest.poll()
    samples = [s for family in KvobsCollector(ingest).collect() for s in family.samples]
    evicted = {(s.labels["model_name"], s.labels["engine"]): s.value for s in samples
               if s.name == "kvobs_evicted_chunks_total" and s.labels["reason"] == "capacity"}
    assert evicted == {("llama", "0"): 1, ("llama", "1"): 1, ("mistral", "0"): 1}  # one engine index, two models
    own = [s for s in samples if s.name.startswith("kvobs_sidecar_")]
    assert own and not any("engine" in s.labels or "model_name" in s.labels for s in own)
    # The checkpoint keeps the identities apart, and a format-2 checkpoint (engine label only) is read.
    restored = SidecarState.from_json(json.loads(json.dumps(ingest.state.to_json())))
    assert set(restored.engines) == {("llama", "0"), ("llama", "1"), ("mistral", "0")}
    old = ingest.state.to_json() | {"format": 2}
    old["engines"] = {e["engine"] + e["model_name"]: e for e in old["engines"]}
    assert set(SidecarState.from_json(old).engines) == {("", "0llama"), ("", "1llama"), ("", "0mistral")}
