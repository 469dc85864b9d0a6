"""ObservedOffloadingConnector: vLLM's OffloadingConnector plus what only the connector knows.

Use it instead of ``OffloadingConnector`` (``"kv_connector": "ObservedOffloadingConnector",
"kv_connector_module_path": "kvobs.vllm.connector"``) to make kvobs's failure span join the
request's trace, and to label kvobs's series with the served model name
(``--served-model-name``; the spec alone sees only the model path). Everything else is vLLM's.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from kvobs.vllm import compat
from kvobs.vllm.trace_context import TraceHeaders


class ObservedOffloadingConnector(OffloadingConnector):
    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        served = compat.SERVED_MODEL_NAME.set(compat.served_name_of(vllm_config))
        try:
            super().__init__(vllm_config, *args, **kwargs)  # builds the spec: kvobs.vllm.spec reads the name
        finally:
            compat.SERVED_MODEL_NAME.reset(served)

    def on_new_request(self, request: Any) -> None:
        super().on_new_request(request)
        headers = getattr(request, "trace_headers", None)
        if not headers or self.connector_scheduler is None:
            return
        req_context = compat.request_context(self.connector_scheduler, request.request_id)
        if req_context is not None:
            req_context.set_state(TraceHeaders(dict(headers)))
