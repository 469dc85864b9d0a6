"""The evidence core: history, promises, near misses, diagnosis; what it records goes to its sinks
(kvobs/sinks.py).

It knows nothing of vLLM: the glue in ``kvobs.vllm`` installs the recorder's taps
(``kvobs.hot_path_loader``) and tells it when a load failed; the observer keeps the
evidence, counts, and hands what it records to sinks, one way. Every sink call is
isolated: a sink's failure is counted and logged once, never raised into the caller.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

from kvobs import forks
from kvobs.applier import APPLIER
from kvobs.boundary import OffloadException
from kvobs.codes import APPLY_BATCH, REASON_CODE, REASONS, RECENT_KEYS, SNAPSHOT_EVERY_S
from kvobs.diagnosis import Diagnosis, KeyFacts, LoadFailure, diagnose
from kvobs.history import EvictionHistory, HistoryStats, Removal
from kvobs.hot_path_loader import Breach, NearMiss, Promises, Recorder, RemovalRun, Verdict
from kvobs.metric_catalogue import new_counts
from kvobs.options import Options
from kvobs.recompute_ledger import RecomputeLedger
from kvobs.sinks import FAILURE_WAIT_S, Deadline, ExceptionEvent, FailureEvent, Sink, Snapshot

T = TypeVar("T")

logger = logging.getLogger("kvobs")

STATS_EVERY_S = 1.0
class Unloadable(NamedTuple):
    """A key of a failed load that cannot be read, as the glue found it in the cache."""

    key: bytes
    group: int
    end_token: int | None
    state: str  # kvobs.diagnosis.MISSING or NOT_READY
    expected_tier: str | None = None  # where the load expected it, as vLLM names it (compat.expected_tier)


class Observer:
    """Keeps the evidence for one offload manager.

    Removal batches are queued by the recorder's taps and folded into the history
    and the sinks by :meth:`drain`, in serial order, on whichever thread drains.
    Reading :attr:`history` drains first, so a reader sees every removal queued
    before the read; :attr:`evicted` and :attr:`batches` are counted as batches are queued.
    """

    def __init__(self, options: Options | None = None, sinks: Iterable[Sink] = (), num_stamps: int = 0) -> None:
        self.options = options or Options()
        self._history = EvictionHistory(self.options.history_size)
        self.counts: dict[str, Counter[str]] = new_counts()
        """The engine's counters, one per totals key of kvobs/metric_catalogue.py: what the recorder's fold counts
        (it holds the same dict) and what this counts (causes, near misses, errors). Read by :meth:`counter`."""
        self.recorder = Recorder(
            max_verdicts=self.options.max_verdicts,
            num_stamps=num_stamps,
            on_error=self.internal_error,
            on_apply=self.drain,
            on_backlog=APPLIER.wake,
            # Below the history's reach, so the history holds every removal the hot path remembers.
            recent_keys=min(RECENT_KEYS, self.options.history_size // 4),
            counts=self.counts,
        )
        self._sinks: tuple[Sink, ...] = ()
        self.flight: Any = None
        """The flight recorder's window (kvobs/flight.py), when one is kept (kvobs.vllm.flight_recorder.start)."""
        self.flight_off_reason: str | None = None
        """Why no flight recorder runs (a bundle says so)."""
        self.dir_problem: str | None = None
        """Why the ``dir`` option's (or KVOBS_DIR's) directory is unusable (kvobs.vllm.evidence found it at start):
        no journal, reports or bundles; None when it is usable or none is set."""
        self.last_bundle_at: float | None = None
        """When (monotonic) the last replay bundle was written (kvobs.vllm.flight_recorder.bundle_on_failure)."""
        self.history_stats: HistoryStats = self._history.stats()
        self.recomputes = RecomputeLedger(self.options.survive_alarm_per_hour, self.counts["survive"])
        """Survive mode's ledger (its counts stay zero unless the ``survive`` option turned loads into recomputes)."""
        self._next_stats_at = 0.0
        self.applier_cpu_s = 0.0
        """CPU seconds kvobs's applier thread spent applying this observer's captures (kvobs/applier.py)."""
        self.explained: deque[BaseException] = deque(maxlen=4)
        """The latest exceptions a failed load's explanation published: the connector's boundary
        (kvobs/vllm/boundary.py) reports each of them no second time."""
        self.guarded = False
        """kvobs's connector sits above this manager (it set this): its boundary reports an exception leaving
        the manager, with the requests' lifecycle, so the manager's taps do not (kvobs/vllm/manager.py)."""
        self._drain_lock = threading.RLock()
        self._draining = False
        self._unpushed = False  # counters changed since the sinks' last Snapshot (pushed by the next drain)
        self._push_due = 0.0  # a drain after this pushes whatever changed (SNAPSHOT_EVERY_S)
        self.forked_from: int | None = None
        """In a child forked from the engine, the parent's pid (kvobs/forks.py, docs/design.md "Fork"): the
        evidence works in-process, nothing is written into the parent's ``dir``."""
        for sink in sinks:
            self.add_sink(sink)
        APPLIER.serve(self)  # applies what the taps capture, off the scheduler thread (kvobs/applier.py)
        forks.track(self)  # a fork while another thread holds the drain lock must not hang the child

    _fork_parts = ("recorder",)
    """Parts whose locks kvobs/forks.py renews with the observer's (the compiled recorder has no weak reference)."""

    def _forked(self) -> None:
        """In a forked child, after kvobs/forks.py renewed the locks: a drain another thread was in is over
        (its captures stay, applied by the child's next read: the child's manager saw those calls too); a
        tapped call another thread was in is over. A sink that owns locks or threads tracks itself
        (kvobs.journal.JournalSink._forked)."""
        self.forked_from = os.getppid()
        self._draining = False
        frame = self.recorder.frame
        if frame is not None and frame[2] != threading.get_ident():
            self.recorder.frame = None

    # -- sinks -----------------------------------------------------------------

    @property
    def sinks(self) -> tuple[Sink, ...]:
        return self._sinks

    def add_sink(self, sink: Sink) -> None:
        """Send everything recorded from now on to ``sink`` too (and bind its fault call)."""
        self.drain()  # what was queued before belongs to the sinks already there
        sink.bind(self.internal_error)
        self._sinks = (*self._sinks, sink)
        self.recorder.keep_residency = any(s.needs_residency for s in self._sinks)

    def pump(self) -> None:
        """Apply what is waiting (skipped when another thread is applying) and push every sink a
        :class:`Snapshot`, changed or not (an exception's publication)."""
        self.drain(block=False)
        self._push_snapshot()

    def _push_snapshot(self) -> None:
        """Every sink a :class:`Snapshot` of the counters and the history's reach as they are (the caller
        drained, or chose not to)."""
        self._push_due = time.monotonic() + SNAPSHOT_EVERY_S
        stats = self.history_stats
        snapshot = Snapshot(self._totals_now(), stats.keys, stats.window(time.monotonic()))
        self._each_sink(lambda s: s.on_snapshot(snapshot))

    # -- the evidence (drained first) ---------------------------------------

    @property
    def history(self) -> EvictionHistory:
        self.drain()  # always: the applier thread may hold captures it took and has not queued yet
        return self._history

    @property
    def promises(self) -> Promises:
        """The promise table, every capture applied first."""
        self.drain()
        return self.recorder.promises

    @property
    def evicted(self) -> Counter[str]:
        """Chunks removed, by reason."""
        return Counter(self.counter("evicted"))

    @property
    def batches(self) -> Counter[str]:
        """Removal batches, by reason."""
        return Counter(self.counter("batches"))

    @property
    def near_misses(self) -> Counter[str]:
        """Hits removed before their load, by the removal's reason (every capture applied first)."""
        self.drain()
        return self.counts["near"]

    @property
    def failures(self) -> Counter[str]:
        """Failed loads, by cause."""
        return self.counts["failures"]

    @property
    def internal_errors(self) -> Counter[str]:
        """kvobs's own faults, by stage (every capture applied first: applying can find some)."""
        self.drain()
        return self.counts["errors"]

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one CPU-tier chunk, set by the spec that sized the tier (kvobs.vllm.compat.chunk_bytes), before
        the manager's first call; 0 (bytes counters stay 0) where nothing says. The recorder's fold reads it."""
        return self.recorder.chunk_bytes

    @chunk_bytes.setter
    def chunk_bytes(self, value: int) -> None:
        self.recorder.chunk_bytes = value

    def counter(self, key: str) -> dict[str, int]:
        """One engine counter now, by its totals key (kvobs/metric_catalogue.py): a copy of :attr:`counts`'s,
        every capture applied first."""
        self.drain()
        return self._counter_now(key)

    def _counter_now(self, key: str) -> dict[str, int]:
        """:meth:`counter` without the drain (the caller drained)."""
        return dict(self.counts[key])

    def totals(self) -> dict[str, dict[str, int]]:
        """Every engine counter now, by totals key (what the journal's totals lines carry)."""
        self.drain()  # once, not once per counter
        return self._totals_now()

    def _totals_now(self) -> dict[str, dict[str, int]]:
        """:meth:`totals` without the drain (the caller drained, or chose not to)."""
        return {key: self._counter_now(key) for key in self.counts}

    # -- recording -------------------------------------------------------

    def drain(self, block: bool = True) -> None:
        """Apply every capture waiting now and fold every queued removal batch, in order (``block=False``:
        skip if another thread is). Applies in rounds of ``APPLY_BATCH`` captures, each under the drain
        lock, folding after each, so a thread waiting for this one waits for at most a round. A round ends
        early where the recorder stops for a fold (a load's broken promises, a full removal queue): the fold
        and the near misses are settled there, against the history as it was at that capture, and the drain
        goes on. The one way evidence moves: the recorder never calls back into this."""
        lock = self._drain_lock
        rec = self.recorder
        waiting = rec.captured  # what is there now; later captures are the next drain's
        while True:
            if not lock.acquire(blocking=block):
                return
            try:
                if self._draining:  # re-entered from a sink (or an apply) on this thread: the outer drain goes on
                    return
                self._draining = True
                try:
                    applied = rec.apply(min(waiting, APPLY_BATCH)) if waiting > 0 else 0
                    waiting -= applied
                    folded = self._fold_queued()
                    self._settle_near()
                    last = waiting <= 0 or not applied  # nothing left applies: another thread took the rest
                    if applied or folded:
                        self._unpushed = True
                    # The sinks get the counters the drain left, under its lock (one way, in order); a count made
                    # outside any drain (the recompute ledger's) within SNAPSHOT_EVERY_S.
                    if last and (self._unpushed or time.monotonic() >= self._push_due):
                        self._unpushed = False
                        self._push_snapshot()
                finally:
                    self._draining = False
            finally:
                lock.release()
            if last:
                return

    def _fold_queued(self) -> int:
        """Fold the removal batches applied so far (with the drain lock held); how many runs."""
        rec = self.recorder
        runs = 0
        while rec.pending:
            self._fold(rec.take_run())
            runs += 1
        return runs

    def _settle_near(self) -> None:
        """Count and publish the near misses the recorder applied (with the drain lock held, every removal
        applied before them folded)."""
        near = self.recorder.near
        while near:
            req_id, redeemed = near.pop(0)
            try:
                self.near_missed(req_id, redeemed)
            except Exception as exc:  # counted, and the next load's are still settled
                self.internal_error("record.load", exc)

    def _fold(self, run: RemovalRun) -> None:
        """History, sinks and gauges for a run of queued batches (called with the drain lock held)."""
        if not run.counts:
            return
        history = self._history
        try:
            history.record_columns(run.first_serial, run.hashes, run.counts, run.times, run.flags, run.reqs)
        except ValueError as exc:  # the queue and the history disagree: said, never raised
            self.internal_error("record.removal", exc)
        for sink in self._sinks:
            try:
                sink.on_removals(run)
            except Exception as exc:  # a sink must never break vLLM
                self.internal_error(sink.stage, exc)
        now = run.times[-1]
        if now >= self._next_stats_at:  # gauges for other threads, at most once a second
            self._next_stats_at = now + STATS_EVERY_S
            self.history_stats = history.stats()

    def breaking_removals(self, keys: Sequence[bytes], verdicts: Sequence[Verdict]) -> list[Removal | None]:
        """For each promise, the first removal of its key after it (the one that broke it), where the
        history holds it; a reset that could not list its keys removed every key. Reads the history as
        the caller's drain left it (a near miss's settling, a failed load's diagnosis)."""
        history = self._history
        found = history.first_removals(keys, [v.serial for v in verdicts])
        reset = self.recorder.recent.unlisted_reset
        if reset < 0:
            return found
        return [history.removal_at(reset) if reset >= v.serial and (r is None or r.serial > reset) else r
                for r, v in zip(found, verdicts, strict=True)]

    def near_missed(self, req_id: str, redeemed: Sequence[tuple[bytes, Verdict, bool]]) -> list[NearMiss]:
        """Count and publish the near misses of a load (``Recorder.near``: ``Promises.redeemed``'s answer);
        them, with their breaches. Called by the drain with every removal before that load folded and none
        after it (the recorder stops there).

        A promise the hot path's short memory could not judge is decided here from the eviction
        history, by the same rule (the first removal after the promise) the cause is named by."""
        broken = [(key, verdict) for key, verdict, decided in redeemed if decided]
        undecided = [(key, verdict) for key, verdict, decided in redeemed if not decided]
        if undecided:
            broken += self._settled_in_history(req_id, undecided)
        if not broken:
            return []
        removals = self.breaking_removals([key for key, _ in broken], [verdict for _, verdict in broken])
        near = [NearMiss(req_id, key, verdict, None if r is None else Breach(r.serial, REASON_CODE[r.reason]))
                for (key, verdict), r in zip(broken, removals, strict=True)]
        by_reason: dict[str, list[NearMiss]] = {}
        for miss in near:
            if miss.breach is not None:  # else the history lost it: counted nowhere rather than wrongly
                by_reason.setdefault(REASONS[miss.breach.reason], []).append(miss)
        for reason, misses in by_reason.items():
            self.counts["near"][reason] += len(misses)
            self._each_sink(lambda s, m=misses, r=reason: s.on_near_miss(m, r))  # type: ignore[misc]
        return near

    def _settled_in_history(
        self, req_id: str, undecided: Sequence[tuple[bytes, Verdict]]
    ) -> list[tuple[bytes, Verdict]]:
        """The promises among ``undecided`` that a removal broke, as the history holds it (none where
        it no longer does: then the cause is ``unknown`` too), each counted once."""
        keys = [key for key, _ in undecided]
        first = self.breaking_removals(keys, [verdict for _, verdict in undecided])
        last = self._history.last_removals(keys)
        reset = self.recorder.recent.unlisted_reset
        now = self.recorder.next_serial
        out = []
        for (key, verdict), breach, latest in zip(undecided, first, last, strict=True):
            if breach is None:
                continue
            last_serial = max(breach.serial, reset, -1 if latest is None else latest.serial)
            if self.recorder.promises.settle(req_id, key, last_serial, now):
                out.append((key, verdict))
        return out

    # -- diagnosis -------------------------------------------------------

    def facts(self, req_id: str, unloadable: Sequence[Unloadable]) -> list[KeyFacts]:
        """Each key's promise, the removal that broke it, and its last removal (the caller drained)."""
        history = self._history
        promises = self.recorder.promises
        keys = [u.key for u in unloadable]
        last = history.last_removals(keys)
        verdicts = [promises.verdict(req_id, key) for key in keys]
        promised = [(i, v) for i, v in enumerate(verdicts) if v is not None]
        first = self.breaking_removals([keys[i] for i, _ in promised], [v for _, v in promised])
        breaking: dict[int, Removal | None] = {i: removal for (i, _), removal in zip(promised, first, strict=True)}
        out = []
        for i, (item, last_removal, verdict) in enumerate(zip(unloadable, last, verdicts, strict=True)):
            removal = breaking.get(i)
            out.append(KeyFacts(
                key=item.key,
                group=item.group,
                end_token=item.end_token,
                state=item.state,
                expected_tier=item.expected_tier,
                verdict=verdict,
                last_removal=last_removal,
                breach=None if removal is None else removal.reason,
                breaking_removal=removal,
                verdicts_dropped=verdict is None and promises.incomplete(req_id),
            ))
        return out

    def load_failed(
        self,
        vllm_message: str,
        req_id: str,
        num_keys: int,
        end_token_range: tuple[int, int] | None,
        unloadable: Sequence[Unloadable],
        failing_group: int | None,
        trace_headers: Mapping[str, str] | None = None,
        recomputed: bool = False,
    ) -> Diagnosis:
        """Diagnose a failed load and log it once (the history is complete and still while it runs):
        at ERROR, or at WARNING when survive mode has vLLM recompute it (``recomputed``)."""
        with self._drain_lock:
            self.drain()
            now = time.monotonic()
            stats = self._history.stats()
            diagnosis = diagnose(
                LoadFailure(
                    vllm_message=vllm_message,
                    req_id=req_id,
                    num_keys=num_keys,
                    end_token_range=end_token_range,
                    missing=self.facts(req_id, unloadable),
                    history_keys=stats.keys,
                    history_window_s=stats.window(now),
                    now=now,
                    failing_group=failing_group,
                    trace_headers=trace_headers,
                    recomputed=recomputed,
                )
            )
        self.counts["failures"][diagnosis.cause] += 1
        self.history_stats = stats
        if recomputed:
            logger.warning("kv offload load failed, recomputed instead (kvobs survive): %s", diagnosis.message)
        else:
            logger.error("kv offload load failed: %s", diagnosis.message)
        return diagnosis

    def applied(self, read: Callable[[], T], *, drained: bool = False) -> T:
        """``read()`` with every capture applied and none applied while it runs (the flight recorder's window
        is read so: kvobs/vllm/flight_recorder.py). ``drained``: this thread applied every capture just now
        (a failed load's diagnosis), and only vLLM's thread captures, so nothing is drained again."""
        with self._drain_lock:
            if not drained:
                self.drain()
            return read()

    def publish_failure(self, diagnosis: Diagnosis, exc: BaseException) -> FailureEvent:
        """Make the failure's event and hand it to every sink (reports, spans); they finish before
        this returns. First every sink's :meth:`Sink.start_failure` (the trace's ids: the first
        sink to give them), then every sink's :meth:`Sink.on_failure` with the one event; it. The sinks
        first get the counters as :meth:`load_failed` left them (its drain the failure's one: a sink
        never pulls)."""
        self._push_snapshot()
        trace, deadline = self._started(lambda sink, d: sink.start_failure(diagnosis, exc, d))
        event = FailureEvent(diagnosis, exc, trace, deadline)
        self._each_sink(lambda s: s.on_failure(event))
        return event

    def publish_exception(self, failure: OffloadException, exc: BaseException) -> ExceptionEvent:
        """As :meth:`publish_failure`, for an exception at the connector's boundary: every sink's
        :meth:`Sink.start_exception`, then every sink's :meth:`Sink.on_exception`, one deadline; the sinks
        first get the counters with every capture applied (skipped if another thread is applying)."""
        self.pump()
        trace, deadline = self._started(lambda sink, d: sink.start_exception(failure, exc, d))
        event = ExceptionEvent(failure, exc, trace, deadline)
        self._each_sink(lambda s: s.on_exception(event))
        return event

    def _started(self, start: Callable[[Sink, Deadline], tuple[str, str] | None]
                 ) -> tuple[tuple[str, str] | None, Deadline]:
        """Every sink's ``start`` under one deadline; the trace's ids (the first sink to give them) and it."""
        trace: tuple[str, str] | None = None
        deadline = Deadline(FAILURE_WAIT_S)
        for sink in self._sinks:
            try:
                ids = start(sink, deadline)
            except Exception as fault:  # a sink must never break vLLM
                self.internal_error(sink.stage, fault)
                continue
            if trace is None and ids is not None:
                trace = ids
        return trace, deadline

    def unavailable(self) -> dict[str, bool]:
        """The parts of kvobs its options ask for that do not work now, by part (kvobs/metric_catalogue.py's
        ``kvobs_unavailable``): ``dir`` set and unusable; ``flight_recorder`` asked for by number
        (``flight_calls``) and not running."""
        return {"dir": self.options.dir is not None and self.dir_problem is not None,
                "flight_recorder": self.options.flight_asked and not self.recording()}

    def recording(self) -> bool:
        """Whether the flight recorder (kvobs.flight.FlightWindow) is recording now."""
        return self.flight is not None and self.flight.off_reason is None

    def writes_bundles(self) -> bool:
        """Whether a failed load or an exception leaving the manager gets a replay bundle
        (kvobs/vllm/flight_recorder.py): ``dir`` set, not a forked child (it writes nothing into the parent's
        ``dir``: kvobs/forks.py), and a flight recorder that started (its bundle says why, if it stopped since)
        or one asked for by number (its bundle's header says why it could not start). A default recorder that
        could not start (a tiering manager) writes none: a bundle without a window would add nothing to the
        failure report."""
        options = self.options
        return (options.dir is not None and self.forked_from is None
                and (self.flight is not None or options.flight_asked))

    def flight_why_not(self) -> str | None:
        """Why the flight recorder is not recording: the reason it did not start, or the one it stopped for."""
        return self.flight_off_reason if self.flight is None else self.flight.off_reason

    # -- fault containment -------------------------------------------------

    def internal_error(self, stage: str, exc: BaseException | None, *, said: bool = False) -> None:
        """Count a fault of kvobs's own; log the first of each stage (``said``: the caller logged it its own
        way, e.g. the one WARNING for an unusable directory)."""
        errors = self.counts["errors"]
        if stage not in errors:
            stage = "sink"
        errors[stage] += 1
        self._unpushed = True  # the next drain pushes it (Observer.drain)
        if errors[stage] == 1 and not said:
            logger.error("kvobs internal error in %s (counted, not raised): %r", stage, exc)

    def _each_sink(self, call: Callable[[Sink], None], stage: str | None = None) -> None:
        for sink in self._sinks:
            try:
                call(sink)
            except Exception as exc:  # a sink must never break vLLM
                self.internal_error(stage or sink.stage, exc)

    def close(self) -> None:
        """Apply everything, push the sinks the final counters (whatever changed them), and close the sinks."""
        APPLIER.forget(self)
        try:
            self.drain()
        except Exception as exc:
            self.internal_error("record.removal", exc)
        try:
            self._push_snapshot()
        except Exception as exc:
            self.internal_error("shutdown", exc)
        self._each_sink(lambda s: s.close(), "shutdown")
