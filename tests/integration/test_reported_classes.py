"""The offload deaths users reported against vLLM, checked on the installed release (issue 42, item 2).

vLLM #55503 (CPU + file-system tiering with MTP: ``_build_store_jobs`` asserts ``len(offload_keys) ==
len(offload_block_ids)`` on the first generation step, reported on 0.26.0) and #49118 (the same assert)
come from blocks allocated ahead of their keys: under speculation a decode step allocates blocks for its
draft tokens, whose block hashes (the keys) exist only once they are verified. Every supported release
bounds the chunks it stores by the keys and never counts tokens beyond the request's (docs/vllm.md,
"The reported classes, by release"). This drives vLLM's real connector scheduler, its tiering manager and
its real fs tier through MTP decode steps that store decode chunks (``offload_prompt_only: false``) and
checks the assert's precondition happens and the assert does not. It fails on a release that loses either
bound. (#54914's class, prepare_load with MTP-retained sliding-window history, fails for real on 0.30.0:
tests/integration/test_fs_tier.py.)
"""

from __future__ import annotations

import random
from pathlib import Path

from demo.driver import EngineStepDriver, build_scheduler, make_request
from demo.incidents import MTP_RETAINED_TOKENS, PRODUCTION, fs_tier
from kvobs.vllm.modelless_config import BLOCK_SIZE
from tests.support.scheduler_harness import DOCUMENT

DRAFTS = 3
"""Speculative tokens a decode step schedules (MTP with 3 tokens; dspark in #54914 used 7)."""


def test_mtp_decode_steps_store_their_chunks_without_reaching_the_build_store_jobs_assert(tmp_path: Path) -> None:
    extra = {**fs_tier(str(tmp_path)), "spec_name": "TieringOffloadingSpec", "offload_prompt_only": False}
    scheduler, _, kv_cache_config = build_scheduler(
        extra, **PRODUCTION, extra_retained_tokens=MTP_RETAINED_TOKENS, num_cpu_chunks=40)
    rng = random.Random(0)
    steps = EngineStepDriver(scheduler, kv_cache_config, spec_tokens=DRAFTS,
                             accepted=lambda _req_id: rng.randint(0, DRAFTS))
    requests = [make_request(f"r{i}", DOCUMENT[: 40 + 23 * i], skip_reading_prefix_cache=i % 2 == 0)
                for i in range(5)]
    ahead_of_keys = decode_stores = 0
    try:
        steps.step(requests[:3])
        for step in range(60):
            # The precondition: a decode step schedules tokens (and allocates blocks) past the last block
            # whose hash, the chunk's key, exists.
            ahead_of_keys += sum(r.num_computed_tokens + 1 + DRAFTS > len(r.block_hashes) * BLOCK_SIZE
                                 for r in steps.running)
            meta = steps.step(requests[3:] if step == 5 else ())
            decode_stores += len(meta.store_jobs) if step > 5 else 0
            if step % 3 == 0:
                steps.report_all_worker_jobs()
            if step == 30:
                for request in steps.running[:2]:
                    steps.finish(request)
        for request in steps.running:
            steps.finish(request)
        steps.step()
        steps.report_all_worker_jobs()
        steps.step()
    finally:
        scheduler.shutdown()
    assert ahead_of_keys > 100, f"decode steps ran ahead of the keys only {ahead_of_keys} times"
    assert decode_stores > 0, "no decode chunk was stored: the assert was never reached"
