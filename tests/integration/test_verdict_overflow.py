"""A full verdict table must not turn into a confident wrong cause.

When ``max_verdicts`` is reached, kvobs drops further lookup verdicts (counted). A request whose
HIT verdict was dropped, and whose chunk is then evicted before its load, did have the chunk
reported: calling that ``coverage_mismatch`` ("this request's lookups never reported the chunk")
would send the operator after the wrong vLLM defect. Real CPU manager.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import LookupResult, ReqContext

from tests.support.causes import failed_load, observed, store
from tests.support.vllm_env import cpu_extra, key, set_position


def test_a_dropped_verdict_is_not_called_a_coverage_mismatch(managers: list[Any]) -> None:
    m = observed(managers, cpu_extra(2), max_verdicts=1)
    writer, a, b = ReqContext("writer"), ReqContext("req-a"), ReqContext("req-b")
    set_position(b, key(2), 32)
    store(m, [key(1), key(2)], writer)
    assert m.lookup(key(1), a) is LookupResult.HIT  # fills the verdict table
    assert m.lookup(key(2), b) is LookupResult.HIT  # this verdict is dropped
    assert m.observer.promises.dropped == 1
    store(m, [key(3), key(4)], writer)  # evicts both after the lookups
    match = failed_load(m, [key(2)], b)
    assert match["cause"] == "unknown", match["evidence"]
    assert "max_verdicts" in match["evidence"]
