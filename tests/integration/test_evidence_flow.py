"""A failed load applies what is pending once, on the failing thread, then reads (issue 43, item 2).

Through vLLM's real CPU manager, with kvobs's defaults and ``dir`` (the journal, the failure reports and the
flight recorder): the failing thread drains once (the diagnosis's), and the report, the journal's totals and
the replay bundle read what that drain left; the totals the journal writes at the failure hold it.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from vllm.v1.kv_offload.base import LookupResult

from kvobs.bundles import BUNDLE_DIR, BUNDLE_SUFFIX
from kvobs.vllm.bundle_replay import load, replay
from kvobs.wire.format import FAILURES_DIR, JOURNAL_DIR
from tests.support.causes import ctx, failed_load, observed, store
from tests.support.vllm_env import cpu_extra, key


def test_a_failed_load_drains_once_and_everything_after_reads(managers: list, tmp_path: Path) -> None:
    m = observed(managers, cpu_extra(4), dir=str(tmp_path))
    observer = m.observer
    a, b = ctx(m, "req-a"), ctx(m, "req-b")
    store(m, [key(1), key(2), key(3), key(4)], a)
    assert m.lookup(key(1), a) is LookupResult.HIT
    store(m, [key(11), key(12), key(13), key(14)], b)  # evicts what the lookup promised
    drains: list[int] = []
    drain, failing_thread = observer.drain, threading.get_ident()

    def counted(block: bool = True) -> Any:
        if threading.get_ident() == failing_thread:  # not the journal writer's periodic pump
            drains.append(observer.recorder.captured)
        return drain(block)

    observer.drain = counted  # type: ignore[method-assign]
    with observer._drain_lock:  # kvobs's applier waits: the failing thread applies what the calls captured
        match = failed_load(m, [key(1)], a)
    assert match["cause"] == "evicted_after_lookup"
    assert len(drains) == 1 and drains[0] > 0, drains  # one drain, and it had the captures to apply
    assert observer.near_misses["capacity"] == 1  # the failed load's broken promise, settled in that drain
    assert len(list((tmp_path / FAILURES_DIR).iterdir())) == 1
    segments = sorted((tmp_path / JOURNAL_DIR).iterdir())
    journal = [json.loads(line) for segment in segments for line in segment.read_text().splitlines()]
    totals = [line for line in journal if line["k"] == "totals"][-1]  # written at the failure (a durable flush)
    assert totals["failures"] == {"evicted_after_lookup": 1} and totals["near"] == {"capacity": 1}, totals
    bundle = load(str(next((tmp_path / BUNDLE_DIR).glob(f"*{BUNDLE_SUFFIX}"))))
    assert bundle.calls[-1][0] == "prepare_load" and replay(bundle).reproduces(bundle)
