"""The ``kvobs demo`` workload: vLLM's real connector scheduler and managers, on CPU.

Each demo engine is a hybrid model (full-attention KV groups plus sliding-window groups)
served through the real ``OffloadingConnectorScheduler`` and the ``ObservedOffloadingSpec``
plugin built by vLLM's own factory; ``demo.driver`` plays the engine's scheduler and
workers. Traffic: multi-turn chats on shared system prompts and questions on shared documents,
under eviction pressure. The defect classes then happen the way they do in production:

* **dp0, CPU engine** (``CPUOffloadingSpec``, two full-attention groups): the allocator keeps
  one chunk of sliding-window history more than the connector's lookup checks, as vLLM's MTP
  retained history did before 0.31 (#56701). This range disagreement is the one thing the demo
  injects (``allocator_retained_tokens``); loads then ask for chunks their lookup never reported.
* **dp1, the production configuration** (``TieringOffloadingSpec`` with vLLM's real
  ``FileSystemTierManager`` on files under the demo's directory, a Gemma-style model of six KV
  groups, MTP retained history): its first requests follow ``incidents.promotion_after_deferral``.
  On vLLM 0.30 the connector ignores the retained history (#56701, for real): a
  ``coverage_mismatch``. From 0.31 this configuration did not fail in our search; the demo
  says so and shows what kvobs counted instead. Nothing is injected.
* **dp2, vLLM #50014 with the fs tier** (one full-attention and one sliding-window group, a
  12-chunk CPU tier): ``incidents.promotion_evicts_hit``; a sliding-window chunk found only in
  the fs tier is promoted inside the lookup pass and its write evicts a full-attention chunk
  the same pass counted as a hit (fails on 0.31 to 0.33). Nothing is injected.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.request import Request

from demo.driver import EngineStepDriver, build_scheduler, make_request
from demo.incidents import (
    DOCUMENT_TOKENS,
    FILLER_TOKENS,
    MTP_RETAINED_TOKENS,
    fs_tier,
    promotion_after_deferral,
    promotion_evicts_hit,
)
from kvobs.codes import read_back_share
from kvobs.vllm.manager import ObservedOffloadingManager
from kvobs.vllm.modelless_config import BLOCK_SIZE

MAX_PROMPT_TOKENS = 512


@dataclass(frozen=True)
class EngineSetup:
    """One demo engine: its spec and shape, and the request pattern its traffic starts with."""

    spec: str
    engine: str
    num_full_groups: int
    num_cpu_chunks: int
    num_sliding_groups: int = 1
    extra_retained_tokens: int = 0
    """vLLM's own ``SlidingWindowSpec.extra_retained_tokens`` (MTP retained history)."""
    allocator_retained_tokens: int = 0
    """Injected: sliding-window history the simulated allocator keeps beyond what the connector knows."""
    fs_tier: bool = False
    incident: str = ""
    """``promotion_evicts_hit`` or ``promotion_after_deferral`` (demo/incidents.py), or none."""
    fails_from: tuple[int, int] = (0, 0)
    fails_until: tuple[int, int] = (99, 0)
    """The releases (major, minor) on which the incident fails (found by search; docs/vllm.md)."""

    def describe(self) -> str:
        full = f"{self.num_full_groups} full-attention group{'s' * (self.num_full_groups > 1)}"
        sliding = f"{self.num_sliding_groups} sliding-window"
        if self.extra_retained_tokens:
            sliding += f" with {self.extra_retained_tokens} tokens of MTP retained history"
        tier = " + vLLM's FileSystemTierManager" if self.fs_tier else ""
        return f"{self.spec}{tier}, hybrid model ({full} + {sliding}), CPU tier of {self.num_cpu_chunks} chunks"

    def incident_fails_on(self, release: tuple[int, int]) -> bool:
        return bool(self.incident) and self.fails_from <= release <= self.fails_until


CPU_ENGINE = EngineSetup("CPUOffloadingSpec", "dp0", num_full_groups=2, num_cpu_chunks=48,
                         allocator_retained_tokens=BLOCK_SIZE)
PRODUCTION_ENGINE = EngineSetup("TieringOffloadingSpec", "dp1", num_full_groups=1, num_sliding_groups=5,
                                num_cpu_chunks=40, extra_retained_tokens=MTP_RETAINED_TOKENS, fs_tier=True,
                                incident="promotion_after_deferral", fails_until=(0, 30))
INCIDENT_ENGINE = EngineSetup("TieringOffloadingSpec", "dp2", num_full_groups=1, num_cpu_chunks=12, fs_tier=True,
                              incident="promotion_evicts_hit", fails_from=(0, 31))


@dataclass(frozen=True)
class Workload:
    """Size of the demo traffic: ``requests`` per engine, or more until ``duration_s`` passed."""

    requests: int = 400
    seed: int = 0
    duration_s: float | None = None
    max_new_per_step: int = 3
    num_system_prompts: int = 8
    num_documents: int = 4
    document_share: float = 0.5
    worker_report_probability: float = 0.8


@dataclass
class EngineRun:
    """What one demo engine did, read from kvobs's own counters."""

    setup: EngineSetup
    requests: int = 0
    steps: int = 0
    seconds: float = 0.0
    evicted: dict[str, int] = field(default_factory=dict)
    near_misses: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    removals_by_path: dict[str, int] = field(default_factory=dict)
    """Removal batches by the manager call they happened in (those the history still details)."""
    tier: dict[str, int] = field(default_factory=dict)
    """The CPU tier in chunks (:func:`tier_summary`, issue 41): written (from the GPU, promoted from the fs
    tier), read, read at least once, evicted, evicted unread, and the read-back share in percent."""
    incident_failed: bool = False


def tier_summary(totals: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
    """The CPU tier's line of the summary, from an engine's totals (``Observer.totals()``), in an order that
    adds up: written = from the GPU + promoted; read at least once <= written; evicted unread <= evicted <=
    written; read back (%) is kvobs.codes.read_back_share, the one definition the README, the dashboard and
    the alert use too (loads over stores is not a share: re-reads count, promotions are not stores)."""
    written = sum(totals["written"].values())
    read_once = sum(totals["read_once"].values())
    share = read_back_share(read_once, written)
    return {"written": written, "from the GPU": sum(totals["stored"].values()),
            "promoted": written - sum(totals["stored"].values()), "read": sum(totals["loaded"].values()),
            "read at least once": read_once, "evicted": sum(totals["evicted"].values()),
            "evicted unread": sum(totals["unread"].values()),
            READ_BACK_LABEL: 0 if share is None else round(100 * share)}


READ_BACK_LABEL = "read back (%)"
"""The summary's name for the read-back share (kvobs.codes.READ_BACK_SHARE), in percent."""


def extra_config(setup: EngineSetup, directory: str) -> dict[str, Any]:
    """``kv_connector_extra_config`` as a user passes it to ``vllm serve`` (see README)."""
    extra: dict[str, Any] = {
        "spec_name": "ObservedOffloadingSpec",
        "spec_module_path": "kvobs.vllm",
        "kvobs": {"inner_spec": setup.spec, "dir": directory, "engine": setup.engine},
    }
    if setup.fs_tier:
        extra.update(fs_tier(f"{directory}/fs-tier-{setup.engine}"))
    elif setup.spec == "TieringOffloadingSpec":
        extra.update(secondary_tiers=[{"type": "example"}], tier_poll_interval_s=0)
    return extra


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 30000) for _ in range(n)]


class Traffic:
    """Prompts of chats and document questions that share prefixes the way real traffic does."""

    def __init__(self, rng: random.Random, workload: Workload, engine: str) -> None:
        self.rng, self.workload, self.engine = rng, workload, engine
        self.documents = [_tokens(rng, BLOCK_SIZE * rng.randrange(4, 13)) for _ in range(workload.num_documents)]
        self.system_prompts = [_tokens(rng, rng.randrange(32, 97)) for _ in range(workload.num_system_prompts)]
        self.chats: list[list[int]] = []  # each turn extends the chat's last prompt and reply
        self.chat_of: dict[str, int] = {}
        self.admitted = 0

    def next_request(self) -> Request:
        rng = self.rng
        chat = -1
        if rng.random() < self.workload.document_share:  # a question on a document, cut at a chunk
            document = self.documents[min(int(rng.paretovariate(1.0)) - 1, len(self.documents) - 1)]
            cut = BLOCK_SIZE * rng.randrange(2, len(document) // BLOCK_SIZE + 1)
            prompt = document[:cut] + _tokens(rng, rng.randrange(1, BLOCK_SIZE))
        else:
            if self.chats and rng.random() < 0.6:
                chat = rng.randrange(len(self.chats))
            else:
                system = self.system_prompts[min(int(rng.paretovariate(1.2)) - 1, len(self.system_prompts) - 1)]
                self.chats.append(list(system))
                chat = len(self.chats) - 1
            prompt = self.chats[chat] + _tokens(rng, rng.randrange(4, 40))
            if len(prompt) > MAX_PROMPT_TOKENS:  # the chat grew too long: start it over
                prompt = self.chats[chat][:BLOCK_SIZE] + _tokens(rng, 8)
            self.chats[chat] = prompt
        request = make_request(f"req-{self.engine}-{self.admitted}", prompt)
        self.chat_of[request.request_id] = chat
        self.admitted += 1
        return request

    def finished(self, request: Request) -> None:
        """The reply joins the chat's history."""
        chat = self.chat_of.pop(request.request_id, -1)
        if chat >= 0:
            self.chats[chat] = list(request.all_token_ids)


def run_engine(
    setup: EngineSetup,
    workload: Workload,
    directory: str,
    on_progress: Callable[[EngineRun], None],
    on_failure: Callable[[AssertionError, Request], None],
) -> EngineRun:
    """Serve the workload on one engine; every failed load goes to ``on_failure`` (vLLM would die)."""
    started = time.monotonic()
    scheduler, _spec, kv_cache_config = build_scheduler(
        extra_config(setup, directory), hybrid=True, num_full_groups=setup.num_full_groups,
        num_sliding_groups=setup.num_sliding_groups, extra_retained_tokens=setup.extra_retained_tokens,
        num_cpu_chunks=setup.num_cpu_chunks,
    )
    manager = scheduler.manager
    assert isinstance(manager, ObservedOffloadingManager)
    driver = EngineStepDriver(scheduler, kv_cache_config, allocator_retained_tokens=setup.allocator_retained_tokens,
                              on_load_failure=on_failure)
    rng = random.Random(f"{workload.seed}-{setup.engine}")
    traffic = Traffic(rng, workload, setup.engine)
    run = EngineRun(setup)
    decode_left: dict[str, int] = {}

    def more() -> bool:
        if traffic.admitted < workload.requests:
            return True
        return workload.duration_s is not None and time.monotonic() - started < workload.duration_s

    def snapshot() -> EngineRun:
        observer = manager.observer
        run.requests, run.seconds = traffic.admitted, time.monotonic() - started
        run.evicted, run.near_misses = dict(observer.evicted), dict(observer.near_misses)
        run.tier = tier_summary(observer.totals())
        run.failures = dict(observer.failures)
        return run

    try:
        failed_before = len(driver.failed_req_ids)
        name = f"{setup.engine}-incident-"
        if setup.incident == "promotion_evicts_hit":
            promotion_evicts_hit(driver, _tokens(rng, DOCUMENT_TOKENS), _tokens(rng, 32), name)
        elif setup.incident == "promotion_after_deferral":
            fillers = [_tokens(rng, FILLER_TOKENS) for _ in range(4)]
            promotion_after_deferral(driver, _tokens(rng, DOCUMENT_TOKENS), fillers, name)
        run.incident_failed = len(driver.failed_req_ids) > failed_before
        while more() or driver.running or driver.pending_job_ids:
            new = [traffic.next_request() for _ in range(rng.randint(0, workload.max_new_per_step)) if more()]
            for request in new:
                decode_left[request.request_id] = rng.randint(1, 8)
            driver.step(new)
            run.steps += 1
            # Workers finish most transfers by the next step; some stay in flight longer.
            pending = driver.pending_job_ids
            driver.report_worker_jobs([j for j in pending if rng.random() < workload.worker_report_probability])
            for request in driver.running:
                left = decode_left[request.request_id] = decode_left.get(request.request_id, 1) - 1
                if left <= 0:
                    driver.finish(request)
                    traffic.finished(request)
            if run.steps % 20 == 0:
                on_progress(snapshot())
        driver.step()  # deliver the last finishes
        driver.report_all_worker_jobs()
        driver.step()
    finally:
        snapshot()
        history = manager.observer.history
        for serial in range(history.next_serial):
            removal = history.removal_at(serial)
            if removal is not None:
                run.removals_by_path[removal.path] = run.removals_by_path.get(removal.path, 0) + 1
        scheduler.shutdown()
    on_progress(run)
    return run
