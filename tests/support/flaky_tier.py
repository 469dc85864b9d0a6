"""An out-of-tree secondary tier whose transfers sometimes fail, as a disk or remote tier's do.

vLLM's in-memory example tier never fails a store (cascade) and fails a load (promotion) only
when a chunk vanished; this subclass fails every ``FAIL_EVERY``-th job of each kind, so vLLM's own
``vllm:kv_offload_tiering_{cascade,promotion}_job_failures`` counters move. Loaded the way vLLM
loads any out-of-tree tier: ``{"type": "FlakyTier", "module_path": "tests.support.flaky_tier"}``.
"""

from __future__ import annotations

import threading
from typing import Any

from vllm.v1.kv_offload.tiering.base import JobResult
from vllm.v1.kv_offload.tiering.example.manager import ExampleSecondaryTierManager

FAIL_EVERY = 5


class FlakyTier(ExampleSecondaryTierManager):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stores = self.loads = 0

    def submit_store(self, job_metadata: Any) -> None:
        self.stores += 1
        if self.stores % FAIL_EVERY == 0:
            self._fail(job_metadata)
            return
        super().submit_store(job_metadata)

    def submit_load(self, job_metadata: Any) -> None:
        self.loads += 1
        if self.loads % FAIL_EVERY == 0:
            self._fail(job_metadata)
            return
        super().submit_load(job_metadata)

    def _fail(self, job_metadata: Any) -> None:
        self.completed_jobs.append(JobResult(job_id=job_metadata.job_id, success=False))


class DeferringTier(ExampleSecondaryTierManager):
    """A tier whose every promotion fails while its I/O may still write into the primary chunks, as a
    remote tier's cancelled read does: vLLM 0.34's ``JobResult.deferred_release`` (an event the tier
    sets once it can no longer write), so the manager drops the keys and holds their chunks
    (``defer_write_release``). Loaded as ``{"type": "DeferringTier", "module_path": "tests.support.flaky_tier"}``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.released: list[threading.Event] = []

    def submit_load(self, job_metadata: Any) -> None:
        event = threading.Event()
        self.released.append(event)
        self.completed_jobs.append(JobResult(job_id=job_metadata.job_id, success=False, deferred_release=event))
