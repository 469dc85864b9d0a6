"""#50014 through vLLM's real OffloadingConnectorScheduler: hybrid FA + SW model, tiering (example tier).

The scenario (see scheduler_harness.reproduce_promotion_evicts_hit): a sliding-window
chunk found only in the secondary tier is promoted during the lookup pass, its
prepare_write evicts a full-attention chunk already counted as a hit, and the
scheduler's prepare_load asserts. kvobs must name it evicted_after_lookup.

With vLLM's in-memory example tier this request pattern fails on 0.33 only: 0.30-0.32 rank their
LRU differently and evict another chunk (test_fs_tier.py has the patterns that fail there).
"""

from __future__ import annotations

import re

import pytest

from tests.support.scheduler_harness import reproduce_promotion_evicts_hit
from tests.support.vllm_env import VLLM

FAILS_HERE = VLLM >= (0, 33)


def test_bare_tiering_spec_reproduces_the_assertion() -> None:
    bare = reproduce_promotion_evicts_hit()
    if not FAILS_HERE:
        assert bare.error is None and bare.num_hit_tokens == 80  # the hit shrank, harmlessly here
        return
    assert isinstance(bare.error, AssertionError)
    assert str(bare.error) == f"Chunk {bare.evicted_hit_key!r} not found in cache"


@pytest.mark.skipif(not FAILS_HERE, reason="this request pattern fails only on vLLM 0.33 (see the module)")
def test_kvobs_names_the_promotion_eviction_through_the_real_scheduler() -> None:
    result = reproduce_promotion_evicts_hit(
        {"kvobs": {"inner_spec": "TieringOffloadingSpec", "engine": "dp0"}},
        spec_name="ObservedOffloadingSpec",
        spec_module_path="kvobs.vllm",
    )
    error = result.error
    assert isinstance(error, AssertionError), "the same assertion type, from the same place"
    text = str(error)
    vllm_text = f"Chunk {result.evicted_hit_key!r} not found in cache"
    assert text.startswith(f"{vllm_text} (group=0, req_id='{result.request_id}'). ")
    assert "1 of 7 keys in this load are missing" in text
    assert re.search(r"per missing key: \[\(80, 0\.\d+\)\]", text), text
    assert "cause: evicted_after_lookup (lookup reported HIT" in text
    # The evicting removal happened inside lookup(): the promotion of the sliding-window chunk.
    assert f"path=lookup, req_id='{result.request_id}'" in text


def test_full_attention_only_cpu_run_has_no_failure_with_kvobs() -> None:
    result = reproduce_promotion_evicts_hit(
        {"kvobs": {"inner_spec": "CPUOffloadingSpec"}},
        spec_name="ObservedOffloadingSpec",
        spec_module_path="kvobs.vllm",
        hybrid=False,
    )
    assert result.error is None
