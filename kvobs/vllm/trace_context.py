"""The request's W3C trace context, carried to kvobs on vLLM's ReqContext.

vLLM's ``ReqContext`` has no trace context (in none of the supported releases), but
``Request.trace_headers`` does; ``kvobs.vllm.connector.ObservedOffloadingConnector`` stores them on the
ReqContext with ``set_state`` (typed scratch space), and kvobs reads them at a
failed load so the failure span joins the request's trace.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class TraceHeaders:
    headers: Mapping[str, str]
