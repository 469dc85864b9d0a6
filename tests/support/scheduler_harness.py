"""vLLM #50014 reproduced through the real ``OffloadingConnectorScheduler`` (see demo.driver)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_offload.base import OffloadKey

from demo.driver import EngineStepDriver, build_scheduler, make_request, offload_key
from demo.incidents import promotion_evicts_hit
from kvobs.vllm.modelless_config import FA_GROUP, SW_GROUP

DOCUMENT = list(range(1000, 1160))
FILLER = list(range(5000, 5032))
FILLERS = [list(range(5000 + 100 * i, 5049 + 100 * i)) for i in range(4)]
"""The incidents' inputs (demo/incidents.py), shared by the tests that replay them."""


@dataclass
class PromotionEvictsHitResult:
    """Outcome of ``reproduce_promotion_evicts_hit``."""

    error: AssertionError | None
    """What ``prepare_load`` raised (None when the run went through)."""
    request_id: str
    """The request whose lookup promoted and whose ``prepare_load`` failed."""
    num_hit_tokens: int | None
    """Its ``get_num_new_matched_tokens`` hit (80 when the bug triggers)."""
    promoted_key: OffloadKey
    """Sliding-window chunk 6, found only in the secondary tier and promoted by the lookup
    (hybrid runs; computed from the block hashes, not observed)."""
    evicted_hit_key: OffloadKey
    """Full-attention chunk 4: a counted hit, evicted by that promotion, then loaded; its
    repr is the key in the assertion message."""


def reproduce_promotion_evicts_hit(
    extra_config_overrides: Mapping[str, Any] | None = None,
    *,
    spec_name: str = "TieringOffloadingSpec",
    spec_module_path: str | None = None,
    hybrid: bool = True,
) -> PromotionEvictsHitResult:
    """Reproduce vLLM #50014 (``demo.incidents.promotion_evicts_hit``) on a fresh engine.

    With ``hybrid=False`` (e.g. ``CPUOffloadingSpec``) the same steps run and ``c`` loads,
    prefills and finishes normally; ``error`` is then None. The spec is always shut down.
    """
    extra: dict[str, Any] = {
        "spec_name": spec_name,
        "secondary_tiers": [{"type": "example"}],
        "tier_poll_interval_s": 0,
        **(extra_config_overrides or {}),
    }
    if spec_module_path is not None:
        extra["spec_module_path"] = spec_module_path
    # Step 1 inserts exactly this many chunks, so the CPU tier is full afterwards.
    scheduler, _spec, kv_cache_config = build_scheduler(extra, hybrid=hybrid, num_cpu_chunks=12 if hybrid else 8)
    driver = EngineStepDriver(scheduler, kv_cache_config)
    try:
        error: AssertionError | None = None
        try:
            run = promotion_evicts_hit(driver, DOCUMENT, FILLER)
        except AssertionError as exc:
            error = exc
        else:  # no failure: let c load, prefill and finish like any request
            w3, c = run.writers[0], run.victim
            driver.report_all_worker_jobs()
            driver.step()
            for request in (w3, run.filler, c):
                driver.finish(request)
            driver.step()
            driver.report_all_worker_jobs()
            driver.step()
        probe = make_request("c", DOCUMENT[:113])  # the same block hashes as the replay's c
        return PromotionEvictsHitResult(
            error=error,
            request_id=probe.request_id,
            num_hit_tokens=driver.num_external_tokens.get(probe.request_id),
            promoted_key=offload_key(probe, 6, SW_GROUP),
            evicted_hit_key=offload_key(probe, 4, FA_GROUP),
        )
    finally:
        scheduler.shutdown()
