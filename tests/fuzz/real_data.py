"""A kvobs directory of real data: vLLM's real CPU manager under ``kvobs.observe()``, its journal, a failed
load's failure report and its replay bundle, and a request answered with a second bundle. The fuzz seeds
(tests/fuzz/corpus/, ``python -m tests.fuzz.real_data``) and the OpenAPI check (tests/integration/
test_openapi.py) start from it."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from vllm.v1.kv_offload.base import LookupResult

from kvobs.bundles import BUNDLE_DIR, BUNDLE_SUFFIX
from kvobs.wire.format import FAILURES_DIR
from tests.support.causes import END, ctx, observed, store
from tests.support.vllm_env import cpu_extra, key


def write(directory: Path) -> None:
    """Fill ``directory`` (which exists): one engine's journal, a failure report and its bundle."""
    managers: list = []
    try:
        m = observed(managers, cpu_extra(4), dir=str(directory), flight_calls=200)
        for i in range(6):  # requests that store, look up, load and finish
            c = ctx(m, f"req-{i}")
            keys = [key(2 * i), key(2 * i + 1)]
            if m.prepare_store(keys, c) is not None:
                m.complete_store(keys, c)
            if m.lookup(keys[0], c) is LookupResult.HIT:
                m.prepare_load([keys[0]], c)
                m.complete_load([keys[0]], c)
            m.on_request_finished(c)
            m.on_schedule_end(END)
        a = ctx(m, "req-a")
        k = key(77)
        store(m, [k], a)
        assert m.lookup(k, a) is LookupResult.HIT
        store(m, [key(78 + i) for i in range(4)], ctx(m, "evicts"))  # k evicted after its lookup
        try:
            m.prepare_load([k], a)
        except AssertionError:
            pass
        else:
            raise AssertionError("the load did not fail")
    finally:
        for manager in managers:
            manager.shutdown()
    deadline = time.monotonic() + 10
    while not list((directory / FAILURES_DIR).glob("*.json")) or not list(
            (directory / BUNDLE_DIR).glob("*" + BUNDLE_SUFFIX)):
        if time.monotonic() > deadline:
            raise AssertionError(f"no failure report or bundle in {directory}")
        time.sleep(0.05)


def seeds(corpus: Path) -> None:
    """Rewrite the seeds of tests/fuzz/corpus/ from a fresh real directory."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        write(directory)
        journals = sorted(p for p in directory.rglob("*.jsonl"))
        reports = sorted((directory / FAILURES_DIR).glob("*.json"))
        bundles = sorted((directory / BUNDLE_DIR).glob("*" + BUNDLE_SUFFIX))
        for name in ("wire", "report", "bundle"):
            shutil.rmtree(corpus / name, ignore_errors=True)
            (corpus / name).mkdir(parents=True)
        for journal in journals:
            lines = [line for line in journal.read_bytes().split(b"\n") if line]
            kinds: dict[bytes, bytes] = {}
            for line in lines:
                kind = line.split(b'"k":', 1)[-1][:12]
                kinds.setdefault(kind, line)
            for n, line in enumerate(kinds.values()):
                (corpus / "wire" / f"line-{n}").write_bytes(line)
            (corpus / "wire" / "journal").write_bytes(b"\n".join(lines[:8]) + b"\n")
        for n, report in enumerate(reports):
            (corpus / "report" / f"report-{n}").write_bytes(report.read_bytes())
        for n, bundle in enumerate(bundles):
            (corpus / "bundle" / f"bundle-{n}").write_bytes(bundle.read_bytes())


if __name__ == "__main__":
    seeds(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "corpus")
