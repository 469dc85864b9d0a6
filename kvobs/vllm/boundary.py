"""Caught at the boundary, never swallowed: an exception leaving vLLM's offloading code through kvobs's connector.

vLLM's offloading connector has dozens of assertions that kill the engine (vLLM #49118, #50454); kvobs
explained one (``prepare_load``'s missing chunk, kvobs/vllm/manager.py). :func:`guard` wraps every
scheduler- and worker-side method of ``ObservedOffloadingConnector`` that the release's
``OffloadingConnector`` has (``compat.CONNECTOR_SCHEDULER_METHODS``, ``compat.CONNECTOR_WORKER_METHODS``):
the call runs as it would; an exception leaving it is reported and then re-raised with a bare ``raise``,
the same object with its traceback. The report: the site (vLLM's file, function, line and expression:
kvobs/sites.py), the requests the call involved with their lifecycle as the connector saw it
(kvobs/lifecycle.py, noted on each guarded call), the connector's recent calls, the releases; the span,
the counter ``kvobs_offload_exceptions{cause, site}``, one log line, and a failure report in the journal
(where the side has kvobs's observer: the scheduler side with kvobs's spec). An exception the failed load's
explanation already published (``Observer.explained``) is not reported again, nor one an outer guarded
call reports. kvobs's own faults here are counted (stage ``boundary``), never raised.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections import Counter, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvobs.boundary import OffloadException, cause_of
from kvobs.journal import ReportFiles
from kvobs.lifecycle import NOT_RECORDED, Lifecycle
from kvobs.observer import Observer
from kvobs.options import Options
from kvobs.sinks import FAILURE_WAIT_S, Deadline, ExceptionEvent
from kvobs.sites import sites_of
from kvobs.vllm import compat
from kvobs.wire.encode import exception_report
from kvobs.wire.format import Writer, fit_model_name

logger = logging.getLogger("kvobs")

_REQUEST_METHODS = frozenset(("on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc",
                              "request_finished", "request_finished_all_groups"))
"""The guarded methods whose first argument is vLLM's ``Request`` and whose call the lifecycle notes."""
_NOTED = _REQUEST_METHODS | {"build_connector_meta"}
"""Every method whose call the lifecycle notes (``build_connector_meta`` for its load and store jobs)."""
_JOB_EVENT = {"load": "load_job", "store": "store_job"}
MAX_REQUESTS = 64
"""Requests a report details (a step's output can name hundreds; the rest are listed by id only)."""
MAX_SITES = 64
"""Sites the engine counts apart per cause (``kvobs.wire.format.MAX_LABEL_VALUES``); beyond, ``other``."""
COUNTER = "exceptions"
"""The totals key of ``kvobs_offload_exceptions`` (kvobs/metric_catalogue.py)."""
SEP = " "
"""Its key: cause, SEP, site (``MetricDef.sep``)."""


class Boundary:
    """One connector's boundary: its lifecycle and what it reported (the counts when it has no observer)."""

    def __init__(self, side: str, observer: Callable[[], Observer | None],
                 options: Callable[[], Options | None] = lambda: None) -> None:
        self.side = side
        self.lifecycle = Lifecycle()
        self._observer = observer
        self._options = options
        self.reported: deque[BaseException] = deque(maxlen=4)
        self.counts: Counter[str] = Counter()
        """``kvobs_offload_exceptions`` of a side without an observer (the worker's): in process; its reports
        (``dir`` set) are what the sidecar counts."""
        self.faults = 0
        self._tracing: Any = None
        self._reports: ReportFiles | None = None

    # -- the lifecycle, on every guarded call ----------------------------------------------

    def noted(self, method: str, args: tuple[Any, ...], result: Any) -> None:
        """What a call that returned says of its requests (a few methods; the rest say nothing). Raw values
        only: the text is made when a report is (kvobs.lifecycle.event_json)."""
        note = self.lifecycle.note
        if method == "build_connector_meta":
            for kind, job_req, job_id in compat.metadata_jobs(result):
                note(_JOB_EVENT[kind], job_req, "job", job_id)
            return
        if method not in _REQUEST_METHODS or not args:
            return
        request = args[0]
        req_id = compat.request_id_of(request)
        if method == "get_num_new_matched_tokens":
            note(method, req_id, "computed", args[1] if len(args) > 1 else None, "matched", result)
        elif method == "update_state_after_alloc":
            note(method, req_id, "external_tokens", args[2] if len(args) > 2 else None)
        else:  # on_new_request, request_finished(_all_groups)
            note(method, req_id, "status", compat.request_status(request), "result", result)

    # -- an exception leaving --------------------------------------------------------------

    def left(self, method: str, exc: BaseException, args: tuple[Any, ...], *,
             recomputed: bool = False) -> OffloadException | None:
        """Report ``exc`` leaving ``method`` (its caller re-raises it; ``recomputed``: survive mode answers vLLM
        instead, and the line is a WARNING): the failure reported, None if none was (reported already, or a
        fault of kvobs's). Never raises."""
        failure = None
        try:
            observer = self._observer()
            if any(e is exc for e in self.reported) or (
                    observer is not None and any(e is exc for e in observer.explained)):
                return None  # reported by an outer call, or explained as a failed load (its own report)
            self.reported.append(exc)
            failure = self.failure(method, exc, args, recomputed=recomputed)
            self.count(failure, observer)
            logger.log(logging.WARNING if recomputed else logging.ERROR, "%s", failure.message,
                       extra={"kvobs_exception": _log_fields(failure)})
            if observer is not None:
                observer.publish_exception(failure, exc)
            else:
                self._span(failure, exc)
            return failure
        except Exception as fault:  # kvobs's own fault: counted; vLLM's exception goes on
            self.faults += 1
            observer = None
            with contextlib.suppress(Exception):
                observer = self._observer()
            if observer is not None:
                observer.internal_error("boundary", fault)
            elif self.faults == 1:
                logger.error("kvobs internal error in boundary (counted, not raised): %r", fault)
            return failure

    def failure(self, method: str, exc: BaseException, args: tuple[Any, ...], *,
                recomputed: bool = False) -> OffloadException:
        from kvobs import __version__

        site, raised_at = sites_of(exc, compat.VLLM_DIR)
        req_ids = _involved(method, args)
        self.lifecycle.note(method, req_ids[0] if len(req_ids) == 1 else None, "raised", type(exc).__name__)
        return OffloadException(
            side=self.side, method=method, cause=cause_of(exc), exception_type=type(exc).__name__,
            vllm_message=str(exc)[:2_000], site=site, raised_at=raised_at, req_ids=req_ids,
            requests=[self.lifecycle.of(r) for r in req_ids[:MAX_REQUESTS]],
            events=self.lifecycle.recent_json(), releases={"vllm": compat.VLLM_VERSION, "kvobs": __version__},
            not_recorded=NOT_RECORDED, time=time.time(), recomputed=recomputed,
        )

    def count(self, failure: OffloadException, observer: Observer | None) -> None:
        """``kvobs_offload_exceptions{cause, site}`` += 1, its sites bounded (``MAX_SITES`` apart)."""
        counts = self.counts if observer is None else observer.counts[COUNTER]
        key = f"{failure.cause}{SEP}{failure.label}" if failure.label else failure.cause
        if key not in counts and len(counts) >= MAX_SITES + 2:
            key = f"{failure.cause}{SEP}other"
        counts[key] += 1

    def _span(self, failure: OffloadException, exc: BaseException) -> None:
        """A side without an observer (the worker's) still exports the span, through the global provider, and
        writes its failure report into ``<dir>/failures/`` when kvobs's options set ``dir`` (the sidecar serves
        and counts it: the worker has no journal)."""
        from kvobs.tracing import TracingSink

        options = self._options()
        if self._tracing is None:
            self._tracing = TracingSink(engine=None if options is None else options.engine,
                                        model_name=None if options is None else options.model_name)
        deadline = Deadline(FAILURE_WAIT_S)
        trace = self._tracing.start_exception(failure, exc, deadline)
        try:
            self._report(failure, exc, options, trace)
        finally:
            self._tracing.on_exception(ExceptionEvent(failure, exc, trace, deadline))

    def _report(self, failure: OffloadException, exc: BaseException, options: Options | None,
                trace: tuple[str, str] | None) -> None:
        if options is None or options.dir is None:
            return
        engine = options.engine or "0"
        if self._reports is None:
            self._reports = ReportFiles(Path(options.dir), engine, options.max_reports)
        writer = Writer(engine, os.getpid(), self.side, fit_model_name(options.model_name or ""))
        report = exception_report(failure, exc, writer, time.time(), trace=trace)
        self._reports.write(self._reports.name(report), report)


def _involved(method: str, args: tuple[Any, ...]) -> list[str]:
    """The requests a call involved: its request argument (a connector's ``Request``, a manager call's
    ``ReqContext``, whichever position it has), else its scheduler output's requests."""
    if not args:
        return []
    for arg in args[:3]:
        req_id = compat.request_id_of(arg)
        if req_id is not None:
            return [req_id]
    if method == "build_connector_meta":
        return compat.output_request_ids(args[0])
    return []


def _log_fields(failure: OffloadException) -> dict[str, Any]:
    """The log record's structured fields (a JSON formatter's ``extra``)."""
    site = failure.site
    return {"cause": failure.cause, "site": failure.label, "side": failure.side, "method": failure.method,
            "file": None if site is None else site.file, "function": None if site is None else site.function,
            "line": None if site is None else site.line, "expression": None if site is None else site.expression,
            "req_ids": list(failure.req_ids[:MAX_REQUESTS]), "exception_type": failure.exception_type,
            "recomputed": failure.recomputed,
            "vllm_version": failure.releases.get("vllm")}


def _guarded(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` guarded; the lifecycle notes its call only if it is one of ``_NOTED`` (a guard alone costs
    about 0.25 us a call, a note 0.45 us more: only the calls that tell a request's story pay for one)."""
    if name in _NOTED:
        @functools.wraps(method)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                result = method(self, *args, **kwargs)
            except Exception as exc:
                _boundary(self).left(name, exc, args)
                raise
            try:
                _boundary(self).noted(name, args, result)
            except Exception:  # a note kvobs could not take: the call's result is vLLM's all the same
                _boundary(self).faults += 1
            return result
    else:
        @functools.wraps(method)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except Exception as exc:
                _boundary(self).left(name, exc, args)
                raise

    call._kvobs_guarded = True  # type: ignore[attr-defined]
    return call


def _boundary(connector: Any) -> Boundary:
    """The connector's boundary, made at its first guarded call; its side is the connector's role. Read and
    set as an attribute, never through the connector's ``__dict__`` (kvobs.vllm.compat.real_dict: a read of it
    would make vLLM's connector code on this object run unspecialised from then on)."""
    found: Boundary | None = getattr(connector, "_kvobs_boundary", None)
    if found is None:
        side = "scheduler" if getattr(connector, "connector_scheduler", None) is not None else "worker"
        found = Boundary(side, lambda: observer_of(connector), lambda: _options_of(connector))
        object.__setattr__(connector, "_kvobs_boundary", found)
    return found


def boundary_of(connector: Any) -> Boundary:
    """The connector's boundary (its lifecycle, what it reported)."""
    return _boundary(connector)


def observer_of(connector: Any) -> Observer | None:
    """kvobs's observer of the connector's manager (its scheduler side with kvobs's spec), else None."""
    scheduler = getattr(connector, "connector_scheduler", None)
    observer = getattr(getattr(scheduler, "manager", None), "observer", None)
    return observer if isinstance(observer, Observer) else None


def _options_of(connector: Any) -> Options | None:
    """kvobs's options where the connector's spec is kvobs's (``ObservedOffloadingSpec.kvobs_options``), else None."""
    options = getattr(compat.worker_spec(connector), "kvobs_options", None)
    return options if isinstance(options, Options) else None


def guard(cls: type) -> type:
    """Guard every scheduler- and worker-side method ``cls`` (a subclass of vLLM's ``OffloadingConnector``)
    has from vLLM's class, as it is there or as ``cls`` overrides it."""
    for name in (*compat.CONNECTOR_SCHEDULER_METHODS, *compat.CONNECTOR_WORKER_METHODS):
        method = getattr(cls, name, None)
        if callable(method) and not getattr(method, "_kvobs_guarded", False):
            setattr(cls, name, _guarded(name, method))
    return cls
