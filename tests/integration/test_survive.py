"""Survive mode at the scheduler level, on vLLM's real managers and real connector (every release).

The manager's part: a load that would assert pins and reads the present prefix through vLLM's own
``prepare_load``, returns a source of the load's full length, and ``complete_load`` unpins exactly
what was pinned. The connector's part: the GPU blocks from the first unreadable chunk on travel in the
connector metadata to a real worker-side connector, whose ``get_block_ids_with_load_errors()`` reports
them once; a request recomputes once, then loads nothing more; start-up refuses what cannot work.
(The engine's recompute and its outputs: tests/engine/test_survive.py, in real engines.)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import types
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.kv_offload.base import LookupResult

from demo import driver
from kvobs.options import OptionError
from kvobs.vllm import ObservedOffloadingManager, compat
from kvobs.vllm.modelless_config import (
    BLOCK_SIZE,
    ModelFacts,
    WithModelFacts,
    make_kv_cache_config,
    make_offloading_config,
    make_vllm_config,
)
from tests.support.causes import END, ctx, observed, store
from tests.support.vllm_env import cpu_extra, key, tiering_extra

RECOMPUTED_LINE = "kv offload load failed, recomputed instead (kvobs survive): "


def armed(managers: list, extra: dict[str, Any], **options: Any) -> ObservedOffloadingManager:
    """An observed manager in survive mode, armed as kvobs's connector arms it."""
    manager = observed(managers, extra, survive=True, **options)
    assert manager.survival is not None
    manager.survival.armed = True
    return manager


def slot_of(manager: ObservedOffloadingManager, k: bytes) -> int:
    """The CPU slot vLLM's own prepare_load reads ``k`` from (pinned, then unpinned again)."""
    probe = ctx(manager, f"probe-{k[-5:].hex()}")
    spec = manager.inner.prepare_load([k], probe)
    manager.inner.complete_load([k], probe)
    return int(spec.block_ids[0])


@pytest.mark.parametrize("extra", [cpu_extra(4), tiering_extra(4)], ids=["cpu", "tiering"])
def test_a_missing_chunk_loads_the_present_prefix_and_pins_balance(
    managers: list, extra: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    m = armed(managers, extra, dir=str(tmp_path))
    a, b = ctx(m, "req-a"), ctx(m, "req-b")
    store(m, [key(2), key(3)], a)
    m.on_schedule_end(END)
    store(m, [key(1)], a)  # LRU order 2, 3, 1: the next store's eviction takes key(2)
    m.on_schedule_end(END)
    assert [m.lookup(key(i), b) for i in (1, 2, 3)] == [LookupResult.HIT] * 3
    present = slot_of(m, key(1))
    store(m, [key(4), key(5)], a)  # a store between lookup and load evicts key(2)

    with caplog.at_level(logging.WARNING, logger="kvobs"):
        spec = m.prepare_load([key(1), key(2), key(3)], b)  # vLLM would assert on key(2)

    # The load keeps its shape: key(1) read from its slot, the rest from a filler (reported failed).
    assert [int(s) for s in spec.block_ids] == [present, 0, 0]
    assert +m.observer.failures == {"evicted_after_lookup": 1}
    assert +m.observer.near_misses == {"capacity": 1}
    warnings = [r for r in caplog.records if r.getMessage().startswith(RECOMPUTED_LINE)]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert "cause: evicted_after_lookup" in warnings[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    m.observer.close()
    (report,) = [json.loads(p.read_text()) for p in (tmp_path / "failures").glob("*.json")]
    assert report["recomputed"] is True and report["cause"] == "evicted_after_lookup"

    # complete_load as the connector calls it, every key of the job: only key(1) was pinned.
    m.complete_load({key(1), key(2), key(3)}, b)
    # key(1)'s pin is gone: new chunks evict it (a leaked pin would keep it resident).
    for i in range(6, 14):
        m.on_schedule_end(END)
        compat.settle_secondary_tiers(m.inner)  # the tiering manager's cascades finish
        if m.prepare_store([key(i)], a) is not None:
            m.complete_store([key(i)], a)
        if compat.chunk_state(compat.cpu_tier_of(m.inner), key(1)):
            break
    assert m.observer.evicted["capacity"] >= 2 and compat.chunk_state(compat.cpu_tier_of(m.inner), key(1)) == "missing"


def test_a_chunk_still_being_stored_follows_the_same_path(managers: list) -> None:
    m = armed(managers, cpu_extra(4))
    a, b = ctx(m, "req-a"), ctx(m, "req-b")
    store(m, [key(1)], a)
    store(m, [key(2)], a, complete=False)  # in flight: present, not ready
    spec = m.prepare_load([key(1), key(2)], b)
    assert [int(s) for s in spec.block_ids] == [slot_of(m, key(1)), 0]
    assert +m.observer.failures == {"store_in_flight": 1}
    m.complete_load([key(1), key(2)], b)  # key(2) was not pinned: not unpinned
    m.complete_store([key(2)], a)  # the store lands as it would have
    c = ctx(m, "req-c")
    assert m.lookup(key(2), c) is LookupResult.HIT
    m.prepare_load([key(1), key(2)], c)
    m.complete_load([key(1), key(2)], c)


def test_not_armed_the_load_fails_as_vllm_fails_it(managers: list, caplog: pytest.LogCaptureFixture) -> None:
    m = observed(managers, cpu_extra(4), survive=True)  # vLLM's own connector: nobody reports blocks
    a = ctx(m, "req-a")
    with caplog.at_level(logging.WARNING, logger="kvobs"), pytest.raises(AssertionError, match="not found in cache"):
        m.prepare_load([key(1)], a)
    assert [r.getMessage() for r in caplog.records if "not armed" in r.getMessage()] == [
        "kvobs survive is on but not armed: kvobs's connector did not arm it (kv_connector must be "
        "ObservedOffloadingConnector, kv_connector_module_path kvobs.vllm.connector); the load fails as vLLM "
        "fails it"]
    assert +m.observer.failures == {"coverage_mismatch": 1}


def test_survive_off_changes_nothing(managers: list) -> None:
    m = observed(managers, cpu_extra(4), flight_calls=0)  # the flight recorder would tap complete_load too
    assert m.survival is None
    assert m.prepare_load is m._kvobs_taps["prepare_load"] and m.complete_load == m.inner.complete_load


# -- the connector -------------------------------------------------------------------------------


def connectors(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *, policy: str = "recompute", hybrid: bool = False,
               defect: str = "LookupEvictsSpec", **options: Any) -> tuple[Any, Any, Path]:
    """kvobs's connector, scheduler and worker sides, as ``vllm serve`` builds them, over vLLM's CPU
    manager with the injected defect (demo/defects.py: the lookup after a HIT evicts it)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from demo.engine import DEFECT_TRIGGER_ENV
    from kvobs.vllm.connector import ObservedOffloadingConnector

    trigger = tmp_path / "trigger"
    monkeypatch.setenv(DEFECT_TRIGGER_ENV, str(trigger))
    kv_cache_config = make_kv_cache_config(hybrid=hybrid)
    extra: dict[str, Any] = {
        "spec_name": "ObservedOffloadingSpec", "spec_module_path": "kvobs.vllm",
        "kvobs": {"inner_spec": defect, "inner_spec_module_path": "demo.defects", "survive": True, **options},
    }
    probe = make_offloading_config(make_vllm_config(extra), kv_cache_config)
    extra["cpu_bytes_to_use"] = driver.cpu_bytes_for_chunks(probe, 16)
    vllm_config = make_vllm_config(extra)
    vllm_config.kv_transfer_config.kv_load_failure_policy = policy
    facts = ModelFacts()
    config = WithModelFacts(vllm_config)
    config.model_config = types.SimpleNamespace(  # type: ignore[assignment]
        **{f.name: getattr(facts, f.name) for f in dataclasses.fields(facts)},
        get_total_num_kv_heads=facts.get_total_num_kv_heads)
    scheduler = ObservedOffloadingConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
    worker = ObservedOffloadingConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    return scheduler, worker, trigger


class ConnectorAsScheduler:
    """The driver plays vLLM's Scheduler for a connector scheduler; this hands it the whole connector
    instead (kvobs's overrides sit there), with the connector's own signatures."""

    def __init__(self, connector: Any) -> None:
        self.connector = connector

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        return self.connector.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> Any:
        return self.connector.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, output: Any) -> Any:
        return self.connector.build_connector_meta(output)

    def request_finished(self, request: Any) -> Any:
        return self.connector.request_finished(request, [])

    def on_new_request(self, request: Any) -> None:
        self.connector.on_new_request(request)

    def update_connector_output(self, output: Any) -> None:
        self.connector.update_connector_output(output)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.connector.connector_scheduler, name)


def store_then_load_armed(scheduler: Any, trigger: Path, *, hybrid: bool, blocks: int) -> tuple[Any, Any, Any]:
    """Through kvobs's connector: "first" stores a prompt of ``blocks`` blocks and finishes; with the defect
    armed, "second" sends the same prompt, whose load finds a chunk missing (vLLM's engine would die
    there). The driver, the second request and the metadata of that step."""
    steps = driver.EngineStepDriver(ConnectorAsScheduler(scheduler), make_kv_cache_config(hybrid=hybrid))
    prompt = list(range(1, blocks * BLOCK_SIZE + 2))
    first = driver.make_request("first", prompt)
    steps.step([first])
    steps.step()
    steps.report_all_worker_jobs()  # its chunks are stored
    steps.finish(first)
    steps.step()
    steps.report_all_worker_jobs()
    trigger.touch()
    second = driver.make_request("second", prompt)
    return steps, second, steps.step([second])


def test_the_connector_reports_the_blocks_and_the_request_recomputes_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    scheduler, worker, trigger = connectors(monkeypatch, tmp_path)
    manager = scheduler.connector_scheduler.manager
    try:
        assert manager.survival is not None and manager.survival.armed
        steps, second, meta = store_then_load_armed(scheduler, trigger, hybrid=False, blocks=4)
        (job,) = [j for j in meta.load_jobs.values() if j.req_id == "second"]
        loaded = [int(b) for b in job.dst_spec.block_ids]
        assert len(job.src_spec.block_ids) == len(loaded) // scheduler.connector_scheduler.config.blocks_per_chunk
        # The first chunk went missing: every block of the load is reported, to each worker, once.
        assert meta.kvobs_failed_block_ids == frozenset(loaded)
        worker.bind_connector_metadata(meta)
        assert worker.get_block_ids_with_load_errors() == set(loaded)
        assert worker.get_block_ids_with_load_errors() == set()
        assert manager.observer.recomputes.counts == {
            "loads": 1, "tokens": steps.num_external_tokens["second"], "alarms": 0}
        assert +manager.observer.failures == {"evicted_after_lookup": 1}

        steps.report_all_worker_jobs()  # complete_load of every key: no assertion
        # vLLM reschedules it from the first failed block; a lookup of it again loads nothing more.
        assert scheduler.get_num_new_matched_tokens(second, 0) == (0, False)
        compat.release_step(scheduler.connector_scheduler)  # that lookup ran outside a step
        steps.step()
        steps.finish(second)
        assert manager.survival.recomputed_requests == set()  # forgotten when it finishes: bounded
        steps.step()
    finally:
        scheduler.shutdown()


def test_start_up_refuses_vllms_fail_policy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(OptionError) as info:
        connectors(monkeypatch, tmp_path, policy="fail")
    assert "'survive'" in str(info.value) and 'kv_load_failure_policy "recompute"' in str(info.value)
    assert "'fail'" in str(info.value)


def test_several_kv_cache_groups_recompute_the_whole_request(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A hybrid model (a full-attention and a sliding-window group): vLLM cannot map failed blocks back
    to requests, so the connector reports the request itself (``failed_recving``, which vLLM's scheduler
    restarts from token 0); its workers report it in the step its load goes out. The defect evicts the
    load's first chunk just before the load (demo.defects.LoadEvictsSpec); tests/engine/
    test_survive.py shows the outputs of a real hybrid engine stay right."""
    scheduler, worker, trigger = connectors(monkeypatch, tmp_path, hybrid=True, defect="LoadEvictsSpec")
    manager = scheduler.connector_scheduler.manager
    try:
        assert manager.survival is not None and manager.survival.armed
        steps, second, meta = store_then_load_armed(scheduler, trigger, hybrid=True, blocks=8)
        assert steps.num_external_tokens["second"], "the second request loads from the CPU tier"
        assert +manager.observer.failures == {"evicted_after_lookup": 1}
        assert manager.observer.recomputes.counts == {
            "loads": 1, "tokens": steps.num_external_tokens["second"], "alarms": 0}
        assert meta.kvobs_failed_req_ids == frozenset({"second"})
        assert not getattr(meta, "kvobs_failed_block_ids", None), "no block ids: vLLM cannot map them here"
        worker.bind_connector_metadata(meta)
        # get_transfer_results (the step's results; tests/engine/test_survive.py runs it for real) adds these
        assert worker._kvobs_failed_requests == {"second"}
        steps.report_all_worker_jobs()  # complete_load of every key: no assertion
        assert scheduler.get_num_new_matched_tokens(second, 0) == (0, False)  # never loads again
        compat.release_step(scheduler.connector_scheduler)
    finally:
        scheduler.shutdown()


def test_a_reset_before_the_survived_load_completes_leaks_no_pin(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    """Issue 31, class 1: a load is survived, then the cache is reset (``/reset_prefix_cache``, an RL
    weight sync) before the workers report that load, so vLLM never calls its ``complete_load``. The
    same prompts are stored and loaded again afterwards: their loads' pins must all come off. Before
    the fix kvobs kept the keys it had not pinned and took them out of those later ``complete_load``
    calls, so every such event left a prompt's chunks pinned for good: here 4 events pin the whole
    CPU tier (16 chunks), and a new prompt is no longer offloaded (``prepare_store`` returns None)."""
    scheduler, _worker, trigger = connectors(monkeypatch, tmp_path, defect="LoadEvictsSpec")
    manager = scheduler.connector_scheduler.manager
    steps = driver.EngineStepDriver(ConnectorAsScheduler(scheduler), make_kv_cache_config(hybrid=False))
    serial = iter(range(1000))

    def run(prompt: list[int], *, reset: bool = False) -> int:
        """One request of ``prompt`` from admission to its stores reported; the tokens it loaded.
        ``reset``: the cache is reset right after its load goes out, before the workers report it."""
        request = driver.make_request(f"req-{next(serial)}", prompt)
        steps.step([request])
        for _ in range(8):  # the connector asks again (None) while this prompt's stores are in flight
            if steps.num_external_tokens[request.request_id] is not None:
                break
            steps.report_all_worker_jobs()
            steps.step()
        if reset:
            scheduler.reset_cache()
        steps.report_all_worker_jobs()
        steps.step()
        steps.report_all_worker_jobs()
        steps.finish(request)
        steps.step()
        steps.report_all_worker_jobs()
        return steps.num_external_tokens[request.request_id] or 0

    prompts = [list(range(1000 * i + 1, 1000 * i + 4 * BLOCK_SIZE + 2)) for i in range(4)]
    try:
        for event, prompt in enumerate(prompts):
            assert not run(prompt)  # stored
            trigger.touch()  # the next load finds its first chunk gone: none of its 4 chunks pinned
            assert run(prompt, reset=True), "the load was survived"
            assert manager.observer.recomputes.counts["loads"] == event + 1
        for prompt in prompts:  # no reset from here on: each prompt stored again and loaded whole
            run(prompt)
            assert run(prompt) == 4 * BLOCK_SIZE

        fresh = list(range(90001, 90001 + 4 * BLOCK_SIZE + 2))
        assert not run(fresh)
        assert run(fresh) == 4 * BLOCK_SIZE, "the CPU tier still takes a new prompt"
        assert manager.survival is not None and not manager.survival._unpinned
    finally:
        scheduler.shutdown()


# -- beyond prepare_load: a lookup that raises --------------------------------------------------


@pytest.mark.parametrize("survive", [True, False], ids=["survive", "off"])
def test_a_lookup_that_raises_reports_no_hit_and_the_request_computes_its_prefix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture, survive: bool
) -> None:
    """Issue 42, item 4: the second request's lookup raises (demo.defects.LookupRaisesSpec: the tier's
    storage fails, OSError EIO). Survive mode answers vLLM "no hit" in its place: no load job, nothing
    pinned, the request computes its prefix itself; the exception is reported as at the boundary (site,
    report marked recomputed, WARNING line, counter) and counted as a recomputed load of 0 tokens. Off,
    vLLM's exception leaves the connector unchanged (the engine dies as without kvobs)."""
    directory = tmp_path / "kvobs"
    scheduler, _worker, trigger = connectors(monkeypatch, tmp_path, defect="LookupRaisesSpec",
                                             dir=str(directory), survive=survive)
    manager = scheduler.connector_scheduler.manager
    steps = driver.EngineStepDriver(ConnectorAsScheduler(scheduler), make_kv_cache_config(hybrid=False))
    prompt = list(range(1, 4 * BLOCK_SIZE + 2))
    caplog.set_level(logging.WARNING, logger="kvobs")
    try:
        first = driver.make_request("first", prompt)
        steps.step([first])
        steps.step()
        steps.report_all_worker_jobs()
        steps.finish(first)
        steps.step()
        steps.report_all_worker_jobs()
        trigger.touch()
        second = driver.make_request("second", prompt)
        if not survive:
            scheduler.on_new_request(second)
            with pytest.raises(OSError, match="could not be read") as info:
                scheduler.get_num_new_matched_tokens(second, 0)
            assert info.value.errno == 5
            assert manager.observer.recomputes.counts["loads"] == 0
            # reported once, by the connector's boundary (the manager's taps leave it to it: Observer.guarded)
            reports = [json.loads(p.read_text()) for p in sorted((directory / "failures").glob("*.json"))]
            assert [(r["side"], r["method"]) for r in reports] == [("scheduler", "get_num_new_matched_tokens")]
            return
        meta = steps.step([second])
        assert steps.num_external_tokens["second"] == 0, "no hit reported"
        assert not [j for j in meta.load_jobs.values() if j.req_id == "second"], "no load job"
        assert manager.observer.recomputes.counts == {"loads": 1, "tokens": 0, "alarms": 0}
        assert +manager.observer.failures == {}, "not a failed load"
        (report,) = [json.loads(p.read_text()) for p in sorted((directory / "failures").glob("*.json"))]
        assert (report["cause"], report["method"], report["recomputed"], report["req_ids"]) == (
            "vllm_exception", "get_num_new_matched_tokens", True, ["second"])
        assert report["site"]["file"].endswith("offloading/scheduler.py"), report["site"]
        assert report["raised_at"]["function"] == "lookup_that_raises"
        (key,) = +manager.observer.counts["exceptions"]
        assert key.startswith("vllm_exception ") and "scheduler.py:" in key
        lines = [r for r in caplog.records if r.getMessage().startswith("kv offload exception at ")]
        assert [r.levelname for r in lines] == ["WARNING"]
        assert lines[0].getMessage().endswith("; computed instead (kvobs survive)")
        assert lines[0].kvobs_exception["recomputed"] is True  # type: ignore[attr-defined]

        steps.report_all_worker_jobs()
        steps.step()
        steps.finish(second)
        steps.step()
        third = driver.make_request("third", prompt)  # fired once: the next lookup hits again
        steps.step([third])
        assert steps.num_external_tokens["third"], "the tier answers again"
    finally:
        scheduler.shutdown()
