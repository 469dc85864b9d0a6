"""A failed load of many keys (a long prompt, every chunk dropped by a reset) still reaches the
sidecar: its report stays under the sidecar's size limit, and the metrics built from reports
(missing chunks by cause and group, their eviction ages) count every key. Real CPU manager.
"""

from __future__ import annotations

import time
from pathlib import Path

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from vllm.v1.kv_offload.base import ReqContext

import kvobs
from kvobs.sidecar.failures import FailureQuery, failure_page
from kvobs.sidecar.ingest import Ingest
from kvobs.tracing import EVENT_NAME, MAX_SPAN_KEYS
from kvobs.wire.format import MAX_REPORT_BYTES
from tests.support.vllm_env import cpu_extra, create_manager, key

KEYS = 14_000  # ~4.8 MB of per-key report before the fix: over MAX_REPORT_BYTES, rejected as corrupt


def test_a_failed_load_of_many_keys_is_reported_whole(tmp_path: Path) -> None:
    directory = tmp_path / "kvobs"
    exporter = InMemorySpanExporter()  # the SDK's own exporter: the span as any exporter gets it
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    manager = kvobs.observe(create_manager(cpu_extra(KEYS)), dir=str(directory), engine="e0",
                            tracer_provider=provider)
    try:
        writer, victim = ReqContext("writer"), ReqContext("victim")
        keys = [key(i) for i in range(KEYS)]
        manager.prepare_store(keys, writer)
        manager.complete_store(keys, writer)
        for i, k in enumerate(keys):
            victim.set_offload_key_position(k, 16 * (i + 1))
            manager.lookup(k, victim)
        manager.reset_cache()
        started = time.monotonic()
        try:
            manager.prepare_load(keys, victim)
        except AssertionError as exc:
            assert f"{KEYS} of {KEYS} keys in this load are missing" in str(exc)
        else:
            raise AssertionError("the load did not fail")
        assert time.monotonic() - started < 10
    finally:
        manager.shutdown()
    [path] = (directory / "failures").glob("*.json")
    assert path.stat().st_size < MAX_REPORT_BYTES / 4
    ingest = Ingest(directory)
    ingest.poll()
    engine = ingest.state.engines[("", "e0")]
    assert sum(ingest.state.skipped.values()) == 0
    assert engine.missing == {("reset_after_lookup", "0"): KEYS}
    assert sum(engine.missing_age["0"].counts) == KEYS
    [report], _ = failure_page(directory / "failures", FailureQuery(limit=10))
    assert report["num_missing"] == KEYS and report["cause"] == "reset_after_lookup"
    assert len(report["missing"]) + report["missing_not_listed"] == KEYS
    [span] = exporter.get_finished_spans()
    [event] = [e for e in span.events if e.name == EVENT_NAME]
    facts = event.attributes
    assert facts is not None and facts["kv_offload.num_missing"] == KEYS
    assert len(facts["kv_offload.missing.end_tokens"]) == MAX_SPAN_KEYS  # 14,000 keys: ~600 kB of span before
    assert facts["kv_offload.missing.not_listed"] == KEYS - MAX_SPAN_KEYS
