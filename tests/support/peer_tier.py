"""An out-of-tree secondary tier that opts into vLLM's tier-poll thread (none of the built-in ones do).

vLLM 0.33.0 starts the ``vllm_offload_tier_poll`` thread only for tiers with
``tolerates_off_thread_polling``; such a tier serves requests of a counterpart the
engine does not drive (a remote peer) from ``serve_external_requests``. This one
is vLLM's in-memory ExampleSecondaryTierManager plus that: each poll round it
looks up the keys its "peer" wants through the parent manager, which starts
promotions from the other tiers, and promotions evict primary chunks, on the
poll thread, with no OffloadingManager method of the wrapper on the stack.
Loaded the way vLLM loads any out-of-tree tier: ``{"type": "PeerTier", "module_path": "tests.support.peer_tier"}``.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.base import ParentManager
from vllm.v1.kv_offload.tiering.example.manager import ExampleSecondaryTierManager


class PeerTier(ExampleSecondaryTierManager):
    tolerates_off_thread_polling: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wanted: list[OffloadKey] = []
        self.rounds = 0
        self.off_thread_rounds = 0

    def serve_external_requests(self, parent: ParentManager) -> None:
        wanted = list(self.wanted)
        if not wanted:
            return
        self.rounds += 1
        if threading.current_thread().name == "vllm_offload_tier_poll":
            self.off_thread_rounds += 1
        context = ReqContext(f"peer-{self.rounds}")
        parent.on_new_request(context)
        try:
            for key in wanted:
                parent.lookup(key, context)
        finally:
            parent.on_request_finished(context)
