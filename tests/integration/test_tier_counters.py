"""Issue 29, "is the tier doing anything": kvobs's stored, loaded and evicted-unread counters against
vLLM's own account of the same run.

vLLM's real CPU offload manager (its LRU policy, with kv events on) runs a random workload: stores
that succeed or fail, lookups, loads of what the lookups reported, capacity evictions. The truth is
vLLM's: the chunks its ``prepare_store`` took (``keys_to_store``), the chunks its events announce
stored (the successful ones) and evicted, and the test's own record of which keys it loaded. kvobs must
count exactly the chunks the tier took to store, the chunks loaded, and, of each removal, the chunks
never loaded since their store. The sidecar then exports the same numbers from the journal.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext

from kvobs.sidecar.ingest import Ingest
from kvobs.sidecar.metrics import KvobsCollector
from tests.support.vllm_env import BYTES_PER_CHUNK, cpu_extra, create_manager, key, observed_extra

pytestmark = pytest.mark.vllm

SLOTS = 24


def drive(seed: int, directory: Path | None = None) -> tuple[dict[str, dict[str, int]], dict[str, int], object]:
    """The random workload; (kvobs's totals, the truth from vLLM's events, the manager)."""
    rng = random.Random(seed)
    options = {} if directory is None else {"dir": str(directory)}
    manager = create_manager(observed_extra(cpu_extra(SLOTS, _events=True), **options))
    truth = {"stored": 0, "loaded": 0, "unread_capacity": 0, "unread_store_failed": 0, "announced": 0}
    read: dict[bytes, bool] = {}  # key -> loaded since its store (resident keys only)

    def account_events() -> None:
        for event in manager.take_events():
            if not event.removed:
                truth["announced"] += len(event.keys)
                read.update(dict.fromkeys(event.keys, False))
            elif not getattr(event, "metadata_only", False):  # 0.33+ also announces a failed store's removal
                truth["unread_capacity"] += sum(not read.pop(k) for k in event.keys)

    for step in range(400):
        context = ReqContext(f"req-{step}")
        if hasattr(manager, "on_new_request"):
            manager.on_new_request(context)
        wanted = [key(i) for i in rng.sample(range(SLOTS * 3), rng.randint(1, 6))]
        hits = [k for k in wanted if manager.lookup(k, context) == LookupResult.HIT]
        if hits:
            manager.prepare_load(hits, context)
            manager.complete_load(hits, context)
            truth["loaded"] += len(hits)
            account_events()
            read.update(dict.fromkeys(hits, True))
        output = manager.prepare_store([k for k in wanted if k not in hits], context)
        if output is not None and output.keys_to_store:
            account_events()  # the evictions this store made, before its keys are stored
            truth["stored"] += len(output.keys_to_store)
            success = rng.random() > 0.15
            manager.complete_store(output.keys_to_store, context, success)
            if not success:
                truth["unread_store_failed"] += len(output.keys_to_store)
        account_events()
        manager.on_request_finished(context)
    totals = manager.observer.totals()
    return totals, truth, manager


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_stored_loaded_and_unread_chunks_agree_with_vllms_own_events(seed: int) -> None:
    totals, truth, manager = drive(seed)
    assert truth["stored"] > SLOTS and truth["loaded"] > 0 and truth["unread_capacity"] > 0, truth
    assert totals["stored"] == {"cpu": truth["stored"]}
    assert truth["announced"] == truth["stored"] - truth["unread_store_failed"]  # vLLM's stored events agree
    assert totals["loaded"] == {"cpu": truth["loaded"]}
    assert totals["unread"]["capacity"] == truth["unread_capacity"]
    assert totals["unread"]["store_failed"] == truth["unread_store_failed"] > 0
    assert totals["unread"]["capacity"] < totals["evicted"]["capacity"]  # some removed chunks had been read
    chunk_bytes = manager.observer.chunk_bytes  # type: ignore[attr-defined]
    assert chunk_bytes == BYTES_PER_CHUNK
    assert totals["stored_bytes"] == {"cpu": truth["stored"] * chunk_bytes}
    assert totals["loaded_bytes"] == {"cpu": truth["loaded"] * chunk_bytes}


def test_a_reset_removes_every_resident_chunk_and_counts_the_unread_ones() -> None:
    totals, _, manager = drive(4)
    manager.reset_cache()  # type: ignore[attr-defined]
    after = manager.observer.totals()  # type: ignore[attr-defined]
    reset = after["evicted"]["reset"]
    assert reset > 0 and 0 < after["unread"]["reset"] <= reset
    assert after["stored"] == totals["stored"] and after["unread"]["capacity"] == totals["unread"]["capacity"]


def test_the_read_bits_take_a_bit_per_slot() -> None:
    """Bounded: one bit per CPU-tier slot, whatever the workload."""
    _, _, manager = drive(5)
    recorder = manager.observer.recorder  # type: ignore[attr-defined]
    assert len(recorder._read) == -(-SLOTS // 8)


def test_the_sidecar_exports_the_tier_counters_the_engine_counted(tmp_path: Path) -> None:
    directory = tmp_path / "kvobs"
    totals, _, manager = drive(6, directory)
    manager.shutdown()  # type: ignore[attr-defined]  # the journal's last totals
    ingest = Ingest(directory)
    ingest.poll()
    samples = {(s.name, s.labels.get("tier") or s.labels.get("reason")): s.value
               for family in KvobsCollector(ingest).collect() for s in family.samples}
    assert samples[("kvobs_stored_chunks_total", "cpu")] == totals["stored"]["cpu"] > 0
    assert samples[("kvobs_loaded_chunks_total", "cpu")] == totals["loaded"]["cpu"] > 0
    assert samples[("kvobs_stored_bytes_total", "cpu")] == totals["stored_bytes"]["cpu"]
    assert samples[("kvobs_loaded_bytes_total", "cpu")] == totals["loaded_bytes"]["cpu"]
    assert samples[("kvobs_evicted_unread_chunks_total", "capacity")] == totals["unread"]["capacity"] > 0
