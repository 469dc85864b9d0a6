"""Issue 41, "every tier counted, and the counts add up": kvobs's tier counters against vLLM's own events
and state, with vLLM's real managers, on every supported release.

The operator's demo printed "stored 1586, loaded 1932" for the CPU tier of a tiering engine: a promotion
from the file tier fills the CPU tier without being a store, and a chunk read twice counts two loads, so
loads over stores was no share. kvobs now counts chunks *written* into the CPU tier by any path (stores
from the GPU plus promotions) and chunks *read at least once* since written; the read-back share is the
one in kvobs.codes.READ_BACK_SHARE. The truth here is vLLM's: the chunks its CPU tier announces stored
(``OffloadingEvent`` with ``removed=False``: a completed store or promotion) and evicted, the chunks
its cache policy still holds, and the test's own record of which announced chunks it loaded.

Invariants checked on every run: written = from the GPU + promoted; read at least once <= written;
evicted unread <= evicted <= written; evicted and read (evicted - evicted unread) <= read at least
once; written - evicted = the chunks vLLM's policy holds; the read-back share <= 1 although loads
exceed it.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

from demo.incidents import fs_tier
from kvobs.codes import read_back_share
from kvobs.sidecar.ingest import Ingest
from kvobs.sidecar.metrics import KvobsCollector
from kvobs.vllm import compat
from tests.support.vllm_env import cpu_extra, create_manager, create_spec, key, observed_extra

pytestmark = pytest.mark.vllm


class Truth:
    """vLLM's account of its CPU tier, from its events: announced stored and removed chunks, and which of
    the resident ones the test has loaded since they were announced."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.announced = 0
        self.removed = 0
        self.failed = 0
        self.read_once = 0
        self.loads = 0
        self.read: dict[Any, bool] = {}

    def events(self) -> None:
        for event in self.manager.take_events():
            if getattr(event, "ownership", None) is not None:  # a secondary tier's own events
                continue
            if not event.removed:
                self.announced += len(event.keys)
                self.read.update(dict.fromkeys(event.keys, False))
            elif getattr(event, "metadata_only", False):  # 0.33+: a failed write's removal
                self.failed += len(event.keys)
            else:
                self.removed += len(event.keys)
                for k in event.keys:
                    self.read.pop(k, None)

    def loaded(self, keys: list[Any]) -> None:
        self.events()  # the completions that made these chunks readable come first
        for k in keys:
            self.loads += 1
            if self.read.get(k) is False:
                self.read[k] = True
                self.read_once += 1


def check_invariants(totals: dict[str, dict[str, int]], resident: int) -> None:
    """The invariants every run must keep, whatever the release and manager."""
    written, stored = totals["written"]["cpu"], totals["stored"]["cpu"]
    read_once, loaded = totals["read_once"]["cpu"], totals["loaded"]["cpu"]
    evicted, unread = sum(totals["evicted"].values()), sum(totals["unread"].values())
    assert written >= stored
    assert read_once <= written and read_once <= loaded
    assert unread <= evicted <= written
    assert evicted - unread <= read_once  # every chunk removed after a read was read once
    assert written - evicted == resident  # vLLM's policy holds exactly what was written and not removed
    share = read_back_share(read_once, written)
    assert share is not None and 0 <= share <= 1


def cpu_resident(manager: Any) -> int:
    return len(compat.resident_chunks(compat.cpu_tier_of(manager.inner)._policy))


@pytest.mark.parametrize("seed", [1, 2])
def test_cpu_tier_counts_agree_with_vllms_events_and_the_share_stays_below_one(seed: int) -> None:
    rng = random.Random(seed)
    slots = 16
    manager = create_manager(observed_extra(cpu_extra(slots, _events=True)))
    truth = Truth(manager)
    stored = failed_stores = 0
    for step in range(300):
        context = ReqContext(f"req-{step}")
        if hasattr(manager, "on_new_request"):
            manager.on_new_request(context)
        wanted = [key(i) for i in rng.sample(range(slots * 2), rng.randint(1, 6))]
        hits = [k for k in wanted if manager.lookup(k, context) == LookupResult.HIT]
        for _ in range(rng.randint(1, 3)):  # re-reads: the same chunks loaded again
            if hits:
                manager.prepare_load(hits, context)
                manager.complete_load(hits, context)
                truth.loaded(hits)
        output = manager.prepare_store([k for k in wanted if k not in hits], context)
        if output is not None and output.keys_to_store:
            truth.events()
            stored += len(output.keys_to_store)
            success = rng.random() > 0.1
            manager.complete_store(output.keys_to_store, context, success)
            failed_stores += 0 if success else len(output.keys_to_store)
        truth.events()
        manager.on_request_finished(context)
    totals = manager.observer.totals()
    assert totals["written"] == totals["stored"] == {"cpu": stored}  # no promotions without tiers
    assert truth.announced == stored - failed_stores  # vLLM announces the successful ones
    assert totals["read_once"] == {"cpu": truth.read_once}
    assert totals["loaded"] == {"cpu": truth.loads}
    assert totals["loaded"]["cpu"] > totals["written"]["cpu"]  # loads over stores is no share...
    assert totals["evicted"]["capacity"] == truth.removed
    check_invariants(totals, cpu_resident(manager))  # ...the read-back share is


def fs_manager(tmp_path: Path, slots: int, **kvobs_options: Any) -> Any:
    spec = create_spec(observed_extra({"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": slots * 4096,
                                       **fs_tier(str(tmp_path / "fs")), "_events": True}, **kvobs_options))
    return spec.get_manager()


def test_promotions_from_the_fs_tier_are_writes_into_the_cpu_tier(tmp_path: Path) -> None:
    """vLLM's real FileSystemTierManager behind a 6-chunk CPU tier: chunks cascade to files, come back by
    promotion (written into the CPU tier, announced by vLLM's stored events) and are read, some twice."""
    rng = random.Random(7)
    m = fs_manager(tmp_path, 6, dir=str(tmp_path / "kvobs"))
    truth = Truth(m)
    end = ScheduleEndContext(new_req_ids=[], preempted_req_ids=())
    try:
        for step in range(120):
            context = ReqContext(f"req-{step}")
            m.on_new_request(context)
            wanted = [key(i) for i in rng.sample(range(24), rng.randint(1, 4))]
            misses = []
            for _ in range(3):  # as the connector does: a key the fs tier answers RETRY or HIT_PENDING for is
                waiting = []    # asked again next step (the promotion completes in between)
                for k in wanted:
                    answer = m.lookup(k, context)
                    if answer == LookupResult.HIT:
                        for _ in range(rng.randint(1, 2)):
                            m.prepare_load([k], context)
                            m.complete_load([k], context)
                            truth.loaded([k])
                    elif answer == LookupResult.MISS:
                        misses.append(k)
                    else:
                        waiting.append(k)
                m.on_schedule_end(end)
                compat.settle_secondary_tiers(m.inner)
                truth.events()
                wanted = waiting
            output = m.prepare_store(misses, context) if misses else None
            if output is not None and output.keys_to_store:
                truth.events()
                m.complete_store(output.keys_to_store, context)
            m.on_schedule_end(end)
            compat.settle_secondary_tiers(m.inner)
            truth.events()
            m.on_request_finished(context)
        last = ReqContext("last")
        m.on_new_request(last)
        for _ in range(2):  # the step's first store polls the tiers: promotions complete
            m.prepare_store([], last)
            m.on_schedule_end(end)
            compat.settle_secondary_tiers(m.inner)
        truth.events()
        totals = m.observer.totals()
        promoted = totals["written"]["cpu"] - totals["stored"]["cpu"]
        assert promoted > 0  # WriteTap's captures, folded into written (kvobs/hot_path.py)
        assert truth.failed == 0 and totals["evicted"]["store_failed"] == 0
        # Every chunk written reached vLLM's stored events (GPU stores and promotions alike), less the ones
        # whose promotion is still in flight: those are resident, not ready, and announced later.
        pending = sum(1 for _, chunk in compat.resident_chunks(compat.cpu_tier_of(m.inner)._policy)
                      if not chunk.is_ready)
        assert totals["written"]["cpu"] == truth.announced + pending
        assert totals["read_once"] == {"cpu": truth.read_once} and truth.read_once > 0
        assert totals["loaded"] == {"cpu": truth.loads}
        assert totals["evicted"]["capacity"] == truth.removed > 0
        check_invariants(totals, cpu_resident(m))
    finally:
        m.shutdown()
    # The sidecar exports the same counts, under the catalogue's names.
    ingest = Ingest(tmp_path / "kvobs")
    ingest.poll()
    samples = {(s.name, s.labels.get("tier")): s.value
               for family in KvobsCollector(ingest).collect() for s in family.samples}
    assert samples[("kvobs_written_chunks_total", "cpu")] == totals["written"]["cpu"]
    assert samples[("kvobs_read_once_chunks_total", "cpu")] == totals["read_once"]["cpu"]


def test_the_demo_summary_adds_up(tmp_path: Path) -> None:
    """The demo's tiering engine with vLLM's fs tier, at scheduler level: its summary line of the CPU tier
    (demo.workload.tier_summary) keeps the invariants and matches what the sidecar exports."""
    from demo.workload import PRODUCTION_ENGINE, READ_BACK_LABEL, Workload, run_engine

    failures: list[AssertionError] = []
    run = run_engine(PRODUCTION_ENGINE, Workload(requests=60), str(tmp_path / "kvobs"), lambda _: None,
                     lambda exc, _request: failures.append(exc))
    tier = run.tier
    assert tier["written"] == tier["from the GPU"] + tier["promoted"] > 0
    assert tier["read at least once"] <= tier["written"] and tier["read at least once"] <= tier["read"]
    assert tier["evicted unread"] <= tier["evicted"] <= tier["written"]
    assert tier["evicted"] - tier["evicted unread"] <= tier["read at least once"]
    assert 0 <= tier[READ_BACK_LABEL] <= 100
    share = read_back_share(tier["read at least once"], tier["written"])
    assert share is not None and tier[READ_BACK_LABEL] == round(100 * share)
    ingest = Ingest(tmp_path / "kvobs")
    ingest.poll()
    samples: dict[str, float] = {}
    for family in KvobsCollector(ingest).collect():
        for s in family.samples:
            if s.labels.get("engine") == PRODUCTION_ENGINE.engine and s.labels.get("tier") == "cpu":
                samples[s.name] = samples.get(s.name, 0) + s.value
    assert samples["kvobs_written_chunks_total"] == tier["written"]
    assert samples["kvobs_read_once_chunks_total"] == tier["read at least once"]
    assert samples["kvobs_stored_chunks_total"] == tier["from the GPU"]
