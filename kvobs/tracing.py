"""One OpenTelemetry span per failed load: ``kv_offload.prepare_load``, status ERROR.

The span carries the standard ``exception`` event and a ``kv_offload.missing_chunks``
event with the structured facts. It is ended and flushed before the exception
leaves kvobs, because the engine is about to die. The bound is kvobs's own, the failure's
deadline every sink shares (``kvobs.sinks.FAILURE_WAIT_S``): the SDK's
``force_flush(timeout)`` exports in the calling thread and waits out the exporter's own
timeout and retries (measured: ~8 s with the OTLP endpoint down, 10 s with one that never
answers), and a ``SimpleSpanProcessor`` exports inside ``span.end()``. So the span is emitted on a short-lived helper
thread that the failing load waits for until that deadline; a span still
exporting after that is left to finish in the background (and the next failure's
span is skipped while it does, so threads stay bounded).

Provider: the one given to ``observe()``, else the global one; if the global one is the
API's no-op default, kvobs builds its own SDK provider from the standard ``OTEL_*``
variables (:func:`provider_from_env`): ``OTEL_TRACES_EXPORTER`` (``otlp``, ``console``,
``none``, comma-separated; unset: ``otlp`` when an ``OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT``
is set, else none), OTLP over http/protobuf by default, grpc on request, and the
resource ``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_SERVICE_NAME`` describe (service.name
``kvobs`` when neither names one).
The parent is the request's W3C trace context when the connector carried it,
else an explicit empty context (EngineCore inherits a stale startup
``traceparent``; notes §5).

The span carries the request id as vLLM's own spans do (``gen_ai.request.id``,
vLLM's ``SpanAttributes.GEN_AI_REQUEST_ID``) and as ``kv_offload.req_id``. By OpenTelemetry's
semantic conventions it also carries ``error.type`` (the cause: kvobs's class of the error, one of
``kvobs.codes.CAUSES``, low-cardinality as the convention asks; the exception's own type is the
``exception`` event's ``exception.type``), the served model as ``gen_ai.request.model`` (the GenAI
conventions' name; left out when kvobs knows no model name) and the engine label as ``kvobs.engine``
(no convention names a data-parallel engine index); its status is ERROR with the cause and vLLM's
message as description.
Its ids go into the failure event every sink receives (``kvobs.sinks.FailureEvent``), so into
the failure report too: the observer asks every sink's ``start_failure`` before any ``on_failure``,
and this sink starts the span there (:meth:`TracingSink.start_failure`), so the report and the
sidecar's exemplar name the trace the backend received, whatever order the sinks were added in.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.semconv.attributes.error_attributes import ERROR_TYPE
from opentelemetry.trace import Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvobs.boundary import OffloadException
from kvobs.diagnosis import Diagnosis
from kvobs.sinks import FAILURE_WAIT_S, SHUTDOWN_WAIT_S, Deadline, ExceptionEvent, FailureEvent, Sink
from kvobs.wire.format import fit_model_name

logger = logging.getLogger("kvobs")

SPAN_NAME = "kv_offload.prepare_load"
EVENT_NAME = "kv_offload.missing_chunks"
EXCEPTION_SPAN_PREFIX = "kv_offload."
"""An exception at the connector's boundary: one span ``kv_offload.<the connector's method>`` (a bounded set)."""
SITE_EVENT = "kv_offload.exception_site"
REQUEST_ID = "gen_ai.request.id"
"""vLLM's own spans' request id attribute (``vllm.tracing.SpanAttributes.GEN_AI_REQUEST_ID``)."""
REQUEST_MODEL = "gen_ai.request.model"
"""The GenAI semantic conventions' model attribute. Not imported: opentelemetry-semantic-conventions
still has it (``_incubating...gen_ai_attributes.GEN_AI_REQUEST_MODEL``, private and marked as moved to
the GenAI conventions' own repository, which has no Python package); tests/unit/test_span_semconv.py
checks it is the same name while the package has it."""
ENGINE = "kvobs.engine"
"""The ``engine`` label of kvobs's series (vLLM's engine index, or the ``engine`` option)."""
DEFAULT_SERVICE_NAME = "kvobs"
EXPORTERS = ("otlp", "console")
"""The ``OTEL_TRACES_EXPORTER`` values kvobs builds (and ``none``)."""
MAX_SPAN_KEYS = 1_000
"""Keys listed per array attribute: a load of 100k keys would make a span of megabytes, over what
OTLP collectors accept (gRPC: 4 MiB), and the span would be lost. The rest are counted."""


def exporter_names() -> list[str]:
    """The exporters ``OTEL_TRACES_EXPORTER`` names, as the SDK reads it (comma-separated; ``none``
    alone: none). Unset: ``otlp`` when an OTLP endpoint is set, else none. An unknown name is
    warned about and left out (a typo exports nothing rather than break the engine)."""
    raw = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not raw:
        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        return ["otlp"] if endpoint else []
    if raw == "none":
        return []
    names: list[str] = []
    for name in (n.strip() for n in raw.split(",")):
        if name in EXPORTERS:
            if name not in names:
                names.append(name)
        elif name and name != "none":
            logger.warning("kvobs: OTEL_TRACES_EXPORTER=%r: unknown exporter %r (kvobs knows %s and none); "
                           "no spans are exported through it", raw, name, ", ".join(EXPORTERS))
    return names


def resource_from_env() -> Any:
    """The SDK's resource from ``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_SERVICE_NAME`` (the latter wins),
    with service.name ``kvobs`` only where neither sets one (instead of the SDK's ``unknown_service``)."""
    from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource

    resource = Resource.create()
    if not OTELResourceDetector().detect().attributes.get(SERVICE_NAME):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    return resource


def _otlp_exporter() -> Any:
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or ""
    ).strip()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter()


def provider_from_env() -> Any | None:
    """An SDK TracerProvider exporting as the ``OTEL_*`` environment says, or None when it asks for
    no exporter (``OTEL_TRACES_EXPORTER=none``, no endpoint, ``OTEL_SDK_DISABLED=true``)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    names = exporter_names()
    if not names:
        return None
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    provider = TracerProvider(resource=resource_from_env())
    for name in names:
        exporter = _otlp_exporter() if name == "otlp" else ConsoleSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def event_attributes(diagnosis: Diagnosis) -> dict[str, Any]:
    """The structured facts of a failed load as OTel attributes (no None inside arrays)."""
    failure = diagnosis.failure
    listed = diagnosis.keys[:MAX_SPAN_KEYS]
    attrs: dict[str, Any] = {
        "kv_offload.req_id": failure.req_id,
        "kv_offload.cause": diagnosis.cause,
        "kv_offload.num_keys": failure.num_keys,
        "kv_offload.num_missing": len(diagnosis.keys),
        "kv_offload.history.keys": failure.history_keys,
        "kv_offload.history.window_s": failure.history_window_s,
        "kv_offload.missing.end_tokens": [-1 if k.facts.end_token is None else k.facts.end_token for k in listed],
        "kv_offload.missing.seconds_since_eviction": [-1.0 if k.age_s is None else k.age_s for k in listed],
        "kv_offload.missing.causes": [k.cause for k in listed],
        "kv_offload.missing.groups": [k.facts.group for k in listed],
        "kv_offload.missing.expected_tiers": [k.facts.expected_tier or "" for k in listed],
        "kv_offload.missing.not_listed": len(diagnosis.keys) - len(listed),
    }
    if failure.failing_group is not None:
        attrs["kv_offload.group"] = failure.failing_group
    if failure.end_token_range is not None:
        attrs["kv_offload.end_token.min"], attrs["kv_offload.end_token.max"] = failure.end_token_range
    return attrs


def exception_attributes(failure: OffloadException) -> dict[str, Any]:
    """The site of an exception at the connector's boundary as OTel attributes."""
    attrs: dict[str, Any] = {"kv_offload.site": failure.label,
                             "kv_offload.vllm_version": failure.releases.get("vllm", "")}
    for prefix, site in (("kv_offload.site.", failure.site), ("kv_offload.raised_at.", failure.raised_at)):
        if site is not None:
            attrs.update({prefix + "file": site.file, prefix + "function": site.function,
                          prefix + "line": site.line, prefix + "expression": site.expression})
    return attrs


class SpanExportTimeout(TimeoutError):
    """The failure span was not exported within the bound (counted as a kvobs fault, never raised to vLLM)."""


@dataclass(frozen=True)
class _Span:
    """What one span carries, whichever failure it reports (:func:`_failure_span`, :func:`_exception_span`):
    one emitter (:meth:`TracingSink._emit`) starts, fills, ends and flushes every span kvobs makes."""

    name: str
    parent: Context
    attributes: dict[str, Any]
    escaped: bool
    """The exception left kvobs (False: survive mode recomputed the load, vLLM never saw the assertion)."""
    event: str
    event_attributes: dict[str, Any]
    status: str


def _failure_span(diagnosis: Diagnosis) -> _Span:
    """A failed load's span, ``kv_offload.load_failure``, under the request's trace when it came with one."""
    failure = diagnosis.failure
    return _Span(SPAN_NAME, parent_context(failure.trace_headers),
                 {REQUEST_ID: failure.req_id, "kv_offload.req_id": failure.req_id,
                  "kv_offload.cause": diagnosis.cause, ERROR_TYPE: diagnosis.cause,
                  "kv_offload.recomputed": failure.recomputed},
                 not failure.recomputed, EVENT_NAME, event_attributes(diagnosis),
                 f"{diagnosis.cause}: {failure.vllm_message[:200]}")


def _exception_span(failure: OffloadException) -> _Span:
    """An exception at the connector's boundary: ``kv_offload.<method>``, a trace of its own."""
    attributes: dict[str, Any] = {
        "kv_offload.cause": failure.cause, ERROR_TYPE: failure.cause, "kv_offload.side": failure.side,
        "kv_offload.method": failure.method, "kv_offload.recomputed": failure.recomputed,
        "kv_offload.req_ids": [str(r) for r in failure.req_ids[:MAX_SPAN_KEYS]]}
    if failure.req_ids:
        attributes[REQUEST_ID] = failure.req_ids[0]
    return _Span(EXCEPTION_SPAN_PREFIX + failure.method, Context(), attributes, not failure.recomputed, SITE_EVENT,
                 exception_attributes(failure), f"{failure.cause} at {failure.label}: {failure.vllm_message[:200]}")


class _Emission:
    """One failure's span, emitted on a helper thread that starts, ends and flushes it by itself;
    ``started`` is set once the span's ids are known (or the attempt is over). ``subject`` is what it
    reports (a Diagnosis or an OffloadException), ``span_of`` makes the span's content, on the helper thread."""

    def __init__(self, sink: TracingSink, subject: object, span_of: Callable[[], _Span], exc: BaseException,
                 deadline: Deadline) -> None:
        self.sink = sink
        self.subject = subject
        self.span_of = span_of
        self.exc = exc
        self.deadline = deadline
        self.started = threading.Event()
        self.ids: tuple[str, str] | None = None  # (trace_id, span_id) of a sampled span
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, name="kvobs-failure-span", daemon=True)

    def remaining(self) -> float:
        return self.deadline.remaining()

    def _run(self) -> None:
        try:
            self.sink._emit(self)
        except BaseException as fault:  # handed to the failing load's thread by TracingSink._finish
            self.errors.append(fault)
        finally:
            self.started.set()


class TracingSink(Sink):
    """Emits the failure span; see the module docstring."""

    stage = "tracing"

    def __init__(self, tracer_provider: Any = None, engine: str | None = None, model_name: str | None = None) -> None:
        """``engine`` and ``model_name``: the labels of this engine's series, set on its spans."""
        self._given = tracer_provider
        self.engine = engine
        self.model_name = fit_model_name(model_name or "")  # as the journal's writer labels the engine
        self._from_env: Any = None
        self._env_read = False
        self._straggler: threading.Thread | None = None
        self._current: _Emission | None = None

    def _provider(self) -> Any:
        if self._given is not None:
            return self._given
        provider = trace.get_tracer_provider()
        if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
            if not self._env_read:  # the environment is read once: an unknown exporter is warned about once
                self._env_read = True
                self._from_env = provider_from_env()
            if self._from_env is not None:
                return self._from_env
        return provider

    def _begin(self, subject: object, span_of: Callable[[], _Span], exc: BaseException,
               deadline: Deadline) -> _Emission:
        """This failure's emission, started on first call (by a ``start_*``, or by the ``on_*`` that ends it)."""
        current = self._current
        if current is not None:
            if current.subject is subject:
                return current
            if current.thread.is_alive():  # begun for a failure its on_* never waited for
                self._straggler = current.thread
        if self._straggler is not None and self._straggler.is_alive():
            raise SpanExportTimeout("the previous failure span is still exporting; this one is skipped")
        emission = _Emission(self, subject, span_of, exc, deadline)
        self._current = emission
        emission.thread.start()
        return emission

    def _started(self, subject: object, span_of: Callable[[], _Span], exc: BaseException,
                 deadline: Deadline) -> tuple[str, str] | None:
        """(trace_id, span_id) in hex of the span when it is sampled, else None: starts the span and waits for
        its start until the failure's deadline. A fault here is met again, and counted once, in ``_finish``."""
        try:
            emission = self._begin(subject, span_of, exc, deadline)
        except Exception:
            return None
        emission.started.wait(emission.remaining())
        return emission.ids

    def start_failure(self, diagnosis: Diagnosis, exc: BaseException, deadline: Deadline) -> tuple[str, str] | None:
        """The failed load's span started (see :meth:`_started`)."""
        return self._started(diagnosis, lambda: _failure_span(diagnosis), exc, deadline)

    def start_exception(self, failure: OffloadException, exc: BaseException,
                        deadline: Deadline) -> tuple[str, str] | None:
        """As :meth:`start_failure`, for an exception at the connector's boundary."""
        return self._started(failure, lambda: _exception_span(failure), exc, deadline)

    def on_exception(self, event: ExceptionEvent) -> None:
        """As :meth:`on_failure`: the span ``kv_offload.<method>``, exported by the deadline."""
        failure = event.failure
        self._finish(self._begin(failure, lambda: _exception_span(failure), event.exc,
                                 event.deadline or Deadline(FAILURE_WAIT_S)))

    def on_failure(self, event: FailureEvent) -> None:
        """Emit and flush the span on a helper thread (begun by :meth:`start_failure`, else now);
        wait until the failure's deadline, which the other sinks share."""
        diagnosis = event.diagnosis
        self._finish(self._begin(diagnosis, lambda: _failure_span(diagnosis), event.exc,
                                 event.deadline or Deadline(FAILURE_WAIT_S)))

    def _finish(self, emission: _Emission) -> None:
        self._current = None
        emission.thread.join(emission.remaining())
        if emission.thread.is_alive():
            self._straggler = emission.thread
            raise SpanExportTimeout(f"failure span not exported by the failure's deadline ({FAILURE_WAIT_S} s "
                                    "for every sink); left to finish")
        if emission.errors:
            raise emission.errors[0]

    def _emit(self, emission: _Emission) -> None:
        """Start the span, publish its ids, fill it, end it and flush the provider within the deadline."""
        from kvobs import __version__

        content = emission.span_of()
        provider = self._provider()
        tracer = provider.get_tracer("kvobs", __version__)
        span = tracer.start_span(content.name, context=content.parent, kind=trace.SpanKind.INTERNAL)
        try:
            context = span.get_span_context()
            if context.is_valid and context.trace_flags.sampled:
                emission.ids = (trace.format_trace_id(context.trace_id), trace.format_span_id(context.span_id))
            emission.started.set()
            span.set_attributes(content.attributes)
            if self.engine is not None:
                span.set_attribute(ENGINE, self.engine)
            if self.model_name:
                span.set_attribute(REQUEST_MODEL, self.model_name)
            span.record_exception(emission.exc, escaped=content.escaped)
            span.add_event(content.event, content.event_attributes)
            span.set_status(Status(StatusCode.ERROR, content.status))
        finally:
            span.end()
        flush = getattr(provider, "force_flush", None)
        if flush is not None:
            flush(int(emission.remaining() * 1000))

    def close(self) -> None:
        """Shut down a provider kvobs built itself, waiting at most SHUTDOWN_WAIT_S (an engine's shutdown)."""
        if self._from_env is not None:
            worker = threading.Thread(target=self._from_env.shutdown, name="kvobs-tracer-shutdown", daemon=True)
            worker.start()
            worker.join(SHUTDOWN_WAIT_S)
            if worker.is_alive():
                raise SpanExportTimeout(f"tracer provider shutdown did not finish within {SHUTDOWN_WAIT_S} s")


def parent_context(trace_headers: Mapping[str, str] | None) -> Context:
    """The request's trace context from W3C headers, else an explicit empty context."""
    if trace_headers:
        return TraceContextTextMapPropagator().extract(carrier=dict(trace_headers), context=Context())
    return Context()
