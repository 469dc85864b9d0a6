"""Request patterns that end in vLLM's offload assertion, replayed through the real scheduler.

``promotion_evicts_hit`` is the pattern of vLLM #50014 on a hybrid (full attention + sliding
window) model with tiering. It needs a freshly started engine whose CPU tier holds 12 chunks
(``build_scheduler(..., hybrid=True, num_full_groups=1, num_cpu_chunks=12)``); nothing else is
staged: the eviction comes from the tiering manager's own promotion inside ``lookup()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vllm.v1.request import Request

from kvobs.demo.driver import EngineStepDriver, make_request

DOCUMENT_TOKENS = 160
"""Tokens of the shared document the pattern's prompts are cut from."""


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
    return PromotionEvictsHit((w3, w2), filler, victim)
