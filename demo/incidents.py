"""Request patterns that end in vLLM's offload assertion, replayed through the real scheduler.

Nothing is injected in any of them: the eviction comes from the tiering manager's own promotion
inside ``lookup()``, or the range disagreement from vLLM's own connector. Which release each one
fails on was found by searching CPU tier sizes on every supported release (docs/vllm.md):

* ``promotion_evicts_hit``: vLLM #50014, 1 full-attention + 1 sliding-window group, a CPU tier
  of 12 chunks. With vLLM's in-memory example tier it fails on 0.33; with the real fs tier on
  0.31, 0.32 and 0.33.
* ``promotion_after_deferral``: the production configuration (``PRODUCTION``: a Gemma-style
  model with 1 full-attention + 5 sliding-window groups, CPU tier + vLLM's
  ``FileSystemTierManager``), a CPU tier of ``PRODUCTION_CPU_CHUNKS``: fails on 0.30, 0.31 and
  0.32 (``evicted_after_lookup``, the promotion inside lookup evicts a counted hit); on 0.33
  no failure (its request-rank LRU keeps the hit).
* the same traffic with MTP retained history (``MTP_RETAINED_TOKENS`` on the sliding-window
  groups): fails on 0.30 as ``coverage_mismatch`` (vLLM #56701: 0.30's connector ignores the
  retained tokens, fixed in 0.31); no failure on 0.31 to 0.33.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm.v1.request import Request

from demo.driver import EngineStepDriver, make_request

DOCUMENT_TOKENS = 160
"""Tokens of the shared document the pattern's prompts are cut from."""

PRODUCTION = {"hybrid": True, "num_full_groups": 1, "num_sliding_groups": 5}
"""``build_scheduler`` keywords of the production configuration: a Gemma-style hybrid model, six KV groups."""
PRODUCTION_CPU_CHUNKS = 29
"""The CPU tier size at which ``promotion_after_deferral`` fails on 0.30, 0.31 and 0.32."""
MTP_RETAINED_TOKENS = 16
"""Sliding-window tokens MTP keeps below the window (``SlidingWindowSpec.extra_retained_tokens``)."""
FILLER_TOKENS = 49
"""Tokens of each unrelated prompt ``promotion_after_deferral`` uses to push the document out."""


def fs_tier(root_dir: str) -> dict[str, Any]:
    """``kv_connector_extra_config`` keys of a CPU tier backed by vLLM's real ``FileSystemTierManager``.

    One read and one write thread (vLLM's default is 16 of each); a tier-poll interval as in
    production (vLLM 0.33 starts the poll thread only for tiers that ask for it; fs does not).
    """
    return {
        "secondary_tiers": [{"type": "fs", "root_dir": root_dir, "n_read_threads": 1, "n_write_threads": 1}],
        "tier_poll_interval_s": 0.001,
    }


@dataclass(frozen=True)
class PromotionEvictsHit:
    """The requests of one ``promotion_evicts_hit`` replay."""

    writers: tuple[Request, Request]
    filler: Request
    victim: Request
    """The request whose lookup promotes and whose ``prepare_load`` then fails."""


def promotion_evicts_hit(
    driver: EngineStepDriver, document: Sequence[int], filler_tokens: Sequence[int], name: str = ""
) -> PromotionEvictsHit:
    """Replay vLLM #50014: a lookup-time promotion evicts a hit that is then loaded.

    Prompts share a document X (chunks of 16 tokens; window 2 chunks; sliding-window chunks
    are stored only as the 2-chunk tail before each prompt's last token). CPU tier: 12 chunks.

    1. ``w3`` (X[:81]) and ``w2`` (X[:129]) prefill in one step. w3 inserts FA0-4, SW3-4; w2
       offers FA0-4 too, but they are write-pending, so w2 inserts (and touches) only
       FA5-7, SW6-7. w2's store completes (cascading to the secondary tier); w3's does not
       yet, and w3 keeps decoding (unfinished: its chunks keep w3's early LRU rank).
    2. w2 finishes: its chunks are re-ranked, tail first (SW7, FA7, SW6, FA6, FA5).
    3. ``filler`` stores 3 chunks; the full CPU tier evicts SW7, FA7, SW6 (w3's chunks are
       write-pending, so not evictable). Then w3's and filler's stores complete.
    4. ``c`` (X[:113]) looks up: FA0-6 HIT; sliding window from the right: SW6 misses the
       CPU tier, hits the secondary tier and is promoted; ``prepare_write`` evicts the oldest
       chunk, FA4 (w3's rank, tail; FA sorts before SW on the tie). SW5 MISS, SW4 and SW3 HIT:
       the hit shrinks to 80 tokens and FA is not looked up again. ``update_state_after_alloc``
       calls ``prepare_load(FA0-4, SW3-4)``, which asserts "Chunk ... not found in cache".

    The last step raises that assertion, or hands it to ``driver.on_load_failure``. With a
    full-attention-only model or the CPU spec, ``c`` simply loads its hit. Unfinished requests
    (w3, filler, and c if it loaded) are the caller's to finish.
    """
    if len(document) < DOCUMENT_TOKENS or len(filler_tokens) < 32:
        raise ValueError(f"need a {DOCUMENT_TOKENS}-token document and 32 filler tokens")
    w3 = make_request(f"{name}w3", document[:81], skip_reading_prefix_cache=True)
    w2 = make_request(f"{name}w2", document[:129], skip_reading_prefix_cache=True)
    filler = make_request(f"{name}filler", filler_tokens[:32], skip_reading_prefix_cache=True)
    victim = make_request(f"{name}c", document[:113])

    meta = driver.step([w3, w2])
    (w2_job,) = [j for j, job in meta.store_jobs.items() if job.req_id == w2.request_id]
    driver.report_worker_jobs([w2_job])  # w3's store stays in flight: not evictable
    driver.finish(w2)
    driver.step()  # delivers w2's finish: on_request_finished re-ranks its chunks
    driver.step([filler])
    driver.report_all_worker_jobs()  # w3's (late) and filler's stores
    driver.step([victim])
    if driver.num_external_tokens.get(victim.request_id) is None:  # an async tier answered RETRY: next step
        driver.step()
    return PromotionEvictsHit((w3, w2), filler, victim)


@dataclass(frozen=True)
class PromotionAfterDeferral:
    """The requests of one ``promotion_after_deferral`` replay."""

    writers: tuple[Request, ...]
    fillers: tuple[Request, ...]
    victim: Request


def promotion_after_deferral(
    driver: EngineStepDriver, document: Sequence[int], fillers: Sequence[Sequence[int]], name: str = ""
) -> PromotionAfterDeferral:
    """A hit counted in one lookup pass, evicted by a promotion in the next (the fs tier defers once).

    On the production configuration (``PRODUCTION``, ``fs_tier``, ``PRODUCTION_CPU_CHUNKS``):

    1. ``w129`` (X[:129]) stores the document's chunks; they cascade to the fs tier. Four
       unrelated prompts (``fillers``) then push every X chunk out of the CPU tier.
    2. ``w81`` (X[:81]) stores X's first chunks again and keeps decoding; ``w145`` (X[:145])
       starts storing the next ones (write-pending: not evictable).
    3. ``c`` (X[:113]) looks up: full-attention hits, write-pending hits, and sliding-window
       chunks only the fs tier holds, whose first fs lookup answers RETRY: ``c`` is deferred.
    4. ``w145``'s store completes. ``c`` looks up again: a sliding-window chunk found in the fs
       tier is promoted, and the promotion evicts the least recently used chunk, which on
       0.30-0.32 is one of ``c``'s counted full-attention hits; the window shrinks the hit, the
       full-attention groups are not looked up again, and ``prepare_load`` asserts.
    """
    if len(document) < DOCUMENT_TOKENS or len(fillers) < 4 or min(map(len, fillers)) < FILLER_TOKENS:
        raise ValueError(f"need a {DOCUMENT_TOKENS}-token document and 4 fillers of {FILLER_TOKENS} tokens")

    def store_and_finish(request: Request) -> None:
        driver.step([request])
        driver.report_all_worker_jobs()
        driver.finish(request)
        driver.step()
        driver.step()

    w129 = make_request(f"{name}w129", document[:129], skip_reading_prefix_cache=True)
    store_and_finish(w129)
    filled = tuple(make_request(f"{name}f{i}", tokens[:FILLER_TOKENS], skip_reading_prefix_cache=True)
                   for i, tokens in enumerate(fillers[:4]))
    for filler in filled:
        store_and_finish(filler)
    w81 = make_request(f"{name}w81", document[:81], skip_reading_prefix_cache=True)
    driver.step([w81])
    driver.report_all_worker_jobs()
    driver.step()
    driver.step()
    w145 = make_request(f"{name}w145", document[:145], skip_reading_prefix_cache=True)
    driver.step([w145])
    victim = make_request(f"{name}c", document[:113])
    driver.step([victim])
    driver.report_all_worker_jobs()
    driver.step()
    return PromotionAfterDeferral((w129, w81, w145), filled, victim)
