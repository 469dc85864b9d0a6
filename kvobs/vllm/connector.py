"""ObservedOffloadingConnector: vLLM's OffloadingConnector plus the request's trace context.

Use it instead of ``OffloadingConnector`` to make kvobs's failure span join the
request's trace (``"kv_connector": "ObservedOffloadingConnector",
"kv_connector_module_path": "kvobs.vllm.connector"``). Everything else is vLLM's.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from kvobs.vllm import compat
from kvobs.vllm.trace_context import TraceHeaders


class ObservedOffloadingConnector(OffloadingConnector):
    def on_new_request(self, request: Any) -> None:
        super().on_new_request(request)
        headers = getattr(request, "trace_headers", None)
        if not headers or self.connector_scheduler is None:
            return
        req_context = compat.request_context(self.connector_scheduler, request.request_id)
        if req_context is not None:
            req_context.set_state(TraceHeaders(dict(headers)))
