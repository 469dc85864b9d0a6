"""The tier each missing chunk was expected in (issue 41): a failed load's report and span say it, as vLLM
names tiers (``CacheHitSource``), from vLLM's own ``get_load_source`` where the release has it (0.32 and
later); on the CPU manager, whose only tier is the host's, on every release. Real managers, every release
(RELEASE_TESTS); the tiering case with vLLM's real file-system tier behind the CPU tier."""

from __future__ import annotations

import json
from pathlib import Path

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from vllm.v1.kv_offload.base import OffloadingManager

from demo.incidents import promotion_evicts_hit
from kvobs.diagnosis import MISSING
from tests.integration.test_fs_tier import observed_fs, run
from tests.integration.test_replay import evicted_after_lookup
from tests.support.causes import failed_load, observed
from tests.support.scheduler_harness import DOCUMENT, FILLERS
from tests.support.vllm_env import VLLM, cpu_extra

HAS_LOAD_SOURCE = hasattr(OffloadingManager, "get_load_source")


def _missing(directory: Path) -> list[dict]:
    [report] = sorted((directory / "failures").glob("*.json"))
    return json.loads(report.read_text())["missing"]


def test_a_cpu_managers_missing_chunk_was_expected_in_the_host_tier(managers: list, tmp_path: Path) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    m = observed(managers, cpu_extra(4), dir=str(tmp_path), tracer_provider=provider)
    keys, a = evicted_after_lookup(m)
    failed_load(m, keys, a)
    [missing] = _missing(tmp_path)
    assert missing["state"] == MISSING and missing["expected_tier"] == "host"
    [span] = exporter.get_finished_spans()
    event = next(e for e in span.events if e.name == "kv_offload.missing_chunks")
    assert list(event.attributes["kv_offload.missing.expected_tiers"]) == ["host"]


def test_a_tiering_managers_missing_chunk_names_the_tier_its_lookup_found(tmp_path: Path) -> None:
    """#50014 with the file-system tier: the lookup found the chunk in the CPU tier, a promotion from the
    file tier evicted it. vLLM's get_load_source says where the lookup found it; before 0.32 vLLM does not
    say, and neither does kvobs (null)."""
    scheduler, driver = observed_fs(tmp_path, hybrid=True, num_cpu_chunks=12)
    try:
        error = run(driver, promotion_evicts_hit, DOCUMENT, FILLERS[0][:32])
    finally:
        scheduler.shutdown()
    if VLLM < (0, 31):  # 0.30 does not fail here (tests/integration/test_fs_tier.py)
        assert error is None
        return
    assert error is not None
    expected = [key["expected_tier"] for key in _missing(tmp_path / "kvobs")]
    assert expected and all(tier == ("host" if HAS_LOAD_SOURCE else None) for tier in expected), expected
