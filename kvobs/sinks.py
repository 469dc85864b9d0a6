"""What the observer (kvobs/observer.py) hands its sinks, one way: the :class:`Sink` protocol, the events of a
failed load and of an exception at the connector's boundary, the counters' :class:`Snapshot`, and the waits
every sink shares. A sink knows nothing of the observer but its bound ``fault`` call."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from kvobs.boundary import OffloadException
    from kvobs.diagnosis import Diagnosis
    from kvobs.hot_path_loader import NearMiss, RemovalRun

logger = logging.getLogger("kvobs")

FAILURE_WAIT_S = 2.0
"""How long a failing load's thread waits for every sink together (the report, the journal's drain, the
span's export): one deadline for all of them (:attr:`FailureEvent.deadline`), since the engine is about
to die and the waits must not add up."""
SHUTDOWN_WAIT_S = 2.0
"""How long a sink's ``close`` waits for anything of its own (a writer thread, an exporter) at an
engine's shutdown, so that a stuck one never hangs it."""



class Deadline:
    """A moment on the monotonic clock that several waits share."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def remaining(self) -> float:
        """Seconds left (0 once it passed)."""
        return max(0.0, self.at - time.monotonic())


class FailureEvent(NamedTuple):
    """One failed load, as every sink receives it (the same object for all)."""

    diagnosis: Diagnosis
    exc: BaseException
    """vLLM's assertion, its message already kvobs's explanation."""
    trace: tuple[str, str] | None = None
    """(trace_id, span_id) in hex of the failure's span when one is sampled (a sink's
    :meth:`Sink.start_failure` started it), else None."""
    deadline: Deadline | None = None
    """When every sink must be done with this failure (``FAILURE_WAIT_S`` from its start): a sink
    waits at most ``deadline.remaining()``."""

    def remaining(self) -> float:
        """Seconds this failure's sinks have left."""
        return FAILURE_WAIT_S if self.deadline is None else self.deadline.remaining()


class ExceptionEvent(NamedTuple):
    """One exception at the connector's boundary (kvobs/vllm/boundary.py), as every sink receives it."""

    failure: OffloadException
    exc: BaseException
    """vLLM's exception, the same object that propagates, unchanged."""
    trace: tuple[str, str] | None = None
    deadline: Deadline | None = None

    def remaining(self) -> float:
        return FAILURE_WAIT_S if self.deadline is None else self.deadline.remaining()


class Snapshot(NamedTuple):
    """The engine's counters and its history's reach at one moment, as the observer pushes them to sinks."""

    counters: dict[str, dict[str, int]]
    """Every engine counter by totals key (kvobs/metric_catalogue.py): :meth:`Observer.totals`."""
    history_keys: int
    history_window_s: float


def _log_fault(stage: str, exc: BaseException) -> None:
    logger.error("kvobs internal error in %s (a sink no observer has bound yet): %r", stage, exc)


class Sink:
    """Receives what the observer records. Methods are no-ops; override what you need.

    A failure reaches the sinks in two rounds, as OpenTelemetry's span processors and exporters
    split the work: :meth:`start_failure` on every sink (the tracing sink starts the failure's span
    there and returns its ids), then :meth:`on_failure` on every sink with one :class:`FailureEvent`
    carrying those ids. No sink knows of another; their order changes nothing.
    """

    stage: str = "sink"
    """The ``stage`` label this sink's own faults are counted under (one of ``kvobs.codes.STAGES``)."""
    needs_residency: bool = False
    """Whether removal runs must carry each key's residency (costs the hot path a little)."""

    fault: Callable[[str, BaseException], None] = staticmethod(_log_fault)
    """Bound by :meth:`Observer.add_sink`: counts a fault of this sink's own thread (``stage``, the error)."""

    def bind(self, fault: Callable[[str, BaseException], None]) -> None:
        """The one call a sink may make into the observer (:attr:`fault`); everything else is pushed to it."""
        self.fault = fault

    def on_snapshot(self, snapshot: Snapshot) -> None:
        """The counters and the history's reach, pushed at the end of each drain that changed them (kvobs's
        applier drains every ``APPLY_EVERY_S``) and before a failure's publication: a sink never pulls."""

    def on_removals(self, run: RemovalRun) -> None:
        """Removal batches, in serial order, on the thread that drains the recorder's queue."""

    def on_near_miss(self, near_misses: Sequence[NearMiss], reason: str) -> None:
        """Promised chunks were removed before their load asked for them."""

    def start_failure(self, diagnosis: Diagnosis, exc: BaseException, deadline: Deadline) -> tuple[str, str] | None:
        """A load failed (first round, done by ``deadline``): the (trace_id, span_id) of the trace this
        sink starts for it, if it starts one, else None."""
        return None

    def on_failure(self, event: FailureEvent) -> None:
        """A load failed (second round); called (and must finish, bounded) before the exception leaves kvobs."""

    def start_exception(self, failure: OffloadException, exc: BaseException,
                        deadline: Deadline) -> tuple[str, str] | None:
        """An exception left vLLM's offloading code (first round, as :meth:`start_failure`)."""
        return None

    def on_exception(self, event: ExceptionEvent) -> None:
        """An exception left vLLM's offloading code (second round, bounded, before it propagates)."""

    def close(self) -> None:
        """Flush and release resources."""
