"""Journals written by kvobs's own writer, the sidecar as a process, and its /metrics read back
(tests/reliability/test_reliability_sidecar_input.py, test_reliability_sidecar_ops.py,
test_reliability_unusual_input.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvobs.journal import JournalSink
from kvobs.observer import Observer
from kvobs.options import Options
from tests.support.removals import record_removal
from tests.support.services import ROOT, free_port, http_get


def write_engine(directory: Path, engine: str, removals: int, fail: bool = False) -> Observer:
    """An engine's journal (and a failure report when ``fail``), through kvobs's own writer."""
    observer = Observer(Options(engine=engine))
    sink = JournalSink(directory, observer.options, "test")
    observer.add_sink(sink)
    for i in range(removals):
        record_removal(observer, [i.to_bytes(32, "big") + b"\0\0\0\0"], "capacity", "store", f"r{i}", [0.5])
    if fail:
        from kvobs.diagnosis import MISSING
        from kvobs.observer import Unloadable

        diagnosis = observer.load_failed("Chunk b'x' not found in cache", "req-f", 1, None,
                                         [Unloadable(b"\1" * 36, 0, None, MISSING)], 0)
        observer.publish_failure(diagnosis, AssertionError(diagnosis.message))
    sink.close()
    return observer


def skipped(values: dict[Any, float], source: str, reason: str) -> float:
    return values[("kvobs_sidecar_skipped_total", frozenset({("source", source), ("reason", reason)}))]


def serve(directory: Path, *, without_file_override: bool = False) -> tuple[subprocess.Popen[str], str]:
    """The sidecar as a process; ``without_file_override`` runs it as root without the capabilities
    that let root read any file, so file modes bind it as they bind the sidecar's own uid in a
    deployment (``nobody`` itself cannot run this interpreter, which lives under ``/root``)."""
    port = free_port()
    prefix = (["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all", "--"]
              if without_file_override else [])
    proc = subprocess.Popen([*prefix, sys.executable, "-m", "kvobs.cli", "serve", "--dir", str(directory),
                             "--port", str(port)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    return proc, f"http://127.0.0.1:{port}"


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    status, _, body = http_get(f"{url}/metrics")
    assert status == 200
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}
