"""The hot path's two implementations behave alike: kvobs.recorder (Python, the reference) and
kvobs._speedups (C). Hypothesis drives both through the same operations and compares everything
either can be asked. Skipped as a whole only where the C twin is not built (it is in `make test`:
tests/unit/test_speedups_built.py fails there otherwise)."""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvobs.history import PATHS, REASONS
from kvobs.recorder import AFTER_FINISHED, AFTER_NONE, AFTER_PINNED, PyRecorder, speedups_module
from kvobs.verdicts import LookupVerdicts, Verdict

C = speedups_module()
pytestmark = pytest.mark.skipif(C is None, reason="kvobs._speedups is not built here")

REQS = ["a", "b", "c"]
KEYS = [bytes([i]) * 36 for i in range(6)]
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- the verdict table -------------------------------------------------------------------------

verdict_ops = st.lists(
    st.one_of(
        st.tuples(st.just("reported"), st.sampled_from(REQS), st.sampled_from(KEYS), st.booleans()),
        st.tuples(st.just("not_reported"), st.sampled_from(REQS), st.sampled_from(KEYS)),
        st.tuples(st.just("pinned"), st.sampled_from(REQS)),
        st.tuples(st.just("loaded"), st.sampled_from(REQS), st.lists(st.sampled_from(KEYS), max_size=4)),
        st.tuples(st.just("finished"), st.sampled_from(REQS)),
        st.tuples(st.just("removed"), st.lists(st.sampled_from(KEYS), max_size=4), st.sampled_from(REASONS)),
        st.tuples(st.just("removed_all"), st.sampled_from(REASONS)),
        st.tuples(st.just("clear")),
    ),
    max_size=60,
)


def _state(verdicts: Any) -> tuple[Any, ...]:
    table = {(r, k): verdicts.get(r, k) for r in REQS for k in KEYS}
    return table, [verdicts.incomplete(r) for r in REQS], len(verdicts), verdicts.dropped, verdicts.watched_keys


@SETTINGS
@given(ops=verdict_ops, max_entries=st.sampled_from([3, 8, 1000]))
def test_c_verdicts_answer_like_the_python_reference(ops: list[tuple[Any, ...]], max_entries: int) -> None:
    ref, fast = LookupVerdicts(max_entries), C.Verdicts(max_entries)
    for serial, (name, *args) in enumerate(ops):
        if name == "reported":
            req, key, pending = args
            args = [req, key, Verdict(serial, float(serial), pending)]
        got = [getattr(v, name)(*args) for v in (ref, fast)]
        assert got[0] == got[1], (name, args)
        assert _state(ref) == _state(fast), (name, args)


def test_c_watch_index_stays_bounded_when_removals_are_never_seen() -> None:
    """Stale watch entries (pinned, finished requests) are swept: memory is bounded."""
    fast = C.Verdicts(1000)
    for i in range(50_000):
        req = f"r{i}"
        fast.reported(req, i.to_bytes(8, "big"), Verdict(i, 0.0, False))
        fast.finished(req)
    assert fast.watched_keys == 0 and len(fast) == 0
    assert fast.watch_entries <= 2 * 4096 + 1


# -- the recorder and its taps -------------------------------------------------------------------

HIT, HIT_PENDING, MISS = object(), object(), object()


@dataclass
class Ctx:
    req_id: str


@dataclass
class Chunk:
    chunk_id: int


@dataclass
class Context:
    new_req_ids: list[str]


class Side:
    """One implementation with its own fake inner methods and logs."""

    def __init__(self, recorder_cls: Any, verdicts: Any, drain_keys: int) -> None:
        self.errors: list[tuple[str, str]] = []
        self.drained: list[Any] = []
        self.failures: list[tuple[str, Any]] = []
        self.near: list[list[tuple[Any, ...]]] = []
        self.calls: list[tuple[Any, ...]] = []
        self.rec = recorder_cls(verdicts, REASONS, 16, self._error, self._drain, lambda: PATHS.index("unobserved"),
                                drain_keys, 4)
        self.result: Any = None
        self.raise_: BaseException | None = None
        self.lookup = self.rec.lookup_tap(self._inner, PATHS.index("lookup"), HIT, HIT_PENDING, True)
        self.store = self.rec.call_tap(self._store, PATHS.index("store"), 1, AFTER_NONE)
        self.finish = self.rec.call_tap(self._inner, PATHS.index("schedule_end"), 0, AFTER_FINISHED)
        self.schedule_end = self.rec.call_tap(self._inner, PATHS.index("schedule_end"), -1, AFTER_PINNED)
        self.load = self.rec.load_tap(self._inner, self._on_failure, self._on_near)
        self.evict = self.rec.evict_tap(self._inner)
        self.allocate = self.rec.allocate_tap(self._inner)
        self.evict_in_store: list[tuple[bytes, Chunk]] = []

    def _error(self, stage: str, exc: BaseException) -> None:
        self.errors.append((stage, type(exc).__name__))

    def _drain(self) -> None:
        self.drained.append(_plain_pending(self.rec.take_pending()))

    def _on_failure(self, exc: BaseException, keys: Any, req: Any) -> None:
        self.failures.append((str(exc), req.req_id))

    def _on_near(self, near: list[Any]) -> None:
        self.near.append([(m.req_id, m.key, m.verdict.serial, m.reason) for m in near])

    def _inner(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((args, tuple(sorted(kwargs))))
        if self.raise_ is not None:
            raise self.raise_
        return self.result

    def _store(self, keys: Any, ctx: Any) -> Any:
        self.calls.append(("store", tuple(keys)))
        if self.raise_ is not None:
            raise self.raise_
        if self.evict_in_store:  # a removal inside the tapped call: path "store", this request
            saved, self.result = self.result, self.evict_in_store
            self.evict(len(self.evict_in_store), set())
            self.result = saved
        return self.result


def _plain_pending(pending: Any) -> Any:
    first, hashes, counts, _times, flags, reqs, records, resets = pending
    plain_records = None if records is None else [
        (serial, reason, path, req, list(keys), None if res is None else len(res), broken)
        for serial, _t, reason, path, req, keys, res, broken in records
    ]
    return first, hashes, counts, flags, list(reqs), plain_records, resets


def _verdicts(v: Any) -> Any:
    return {(r, k): (None if (x := v.get(r, k)) is None else (x.serial, x.pending)) for r in REQS for k in KEYS}


recorder_ops = st.lists(
    st.one_of(
        st.tuples(st.just("lookup"), st.sampled_from(REQS), st.sampled_from(KEYS),
                  st.sampled_from(["hit", "pending", "miss", "raise"]), st.booleans()),
        st.tuples(st.just("store"), st.sampled_from(REQS), st.lists(st.sampled_from(KEYS), max_size=3)),
        st.tuples(st.just("evict"), st.lists(st.integers(0, 5), max_size=4)),
        st.tuples(st.just("allocate"), st.lists(st.integers(0, 20), max_size=3)),
        st.tuples(st.just("removal"), st.lists(st.sampled_from(KEYS), max_size=3), st.integers(0, 2),
                  st.sampled_from([-1, 0, 3])),
        st.tuples(st.just("load"), st.sampled_from(REQS), st.lists(st.sampled_from(KEYS), max_size=3),
                  st.sampled_from(["ok", "assert", "other"])),
        st.tuples(st.just("finish"), st.sampled_from(REQS)),
        st.tuples(st.just("schedule_end"), st.lists(st.sampled_from(REQS), max_size=2)),
        st.tuples(st.just("keep_batches"), st.booleans()),
        st.tuples(st.just("take")),
    ),
    max_size=40,
)


def _run(side: Side, op: tuple[Any, ...]) -> Any:
    """Apply one operation; what it returned or raised, comparable across the two sides."""
    name, *args = op
    side.raise_, side.result, side.evict_in_store = None, None, []
    try:
        if name == "lookup":
            req, key, answer, by_keyword = args
            if answer == "raise":
                side.raise_ = KeyError("inner")
            side.result = {"hit": HIT, "pending": HIT_PENDING, "miss": MISS}.get(answer)
            out = side.lookup(key, req_context=Ctx(req)) if by_keyword else side.lookup(key, Ctx(req))
            return "ok", {HIT: "hit", HIT_PENDING: "pending", MISS: "miss"}[out]
        if name == "store":
            req, keys = args
            side.evict_in_store = [(k, Chunk(i)) for i, k in enumerate(keys)]
            side.store(keys, Ctx(req))
            return "ok"
        if name == "evict":
            side.result = [(KEYS[i], Chunk(i)) for i in args[0]] or None
            return "ok", side.evict(len(args[0]), set()) is side.result
        if name == "allocate":
            side.result = [Chunk(i) for i in args[0]]  # ids past 15 are outside the stamped slots
            return "ok", side.allocate(list(args[0])) is side.result
        if name == "removal":
            keys, reason, path = args
            side.rec.removal(list(keys), reason, [1.0] * len(keys), 5.0, path, "x" if path >= 0 else None)
            return "ok"
        if name == "load":
            req, keys, outcome = args
            side.raise_ = {"assert": AssertionError("Chunk not found"), "other": ValueError("no")}.get(outcome)
            side.result = "spec"
            return "ok", side.load(keys, Ctx(req))
        if name == "finish":
            return "ok", side.finish(Ctx(args[0]))
        if name == "schedule_end":
            return "ok", side.schedule_end(Context(args[0]))
        if name == "keep_batches":
            side.rec.keep_batches = int(args[0])
            return "ok"
        if name == "take":
            return "ok", _plain_pending(side.rec.take_pending())
    except Exception as exc:
        return "raised", type(exc).__name__, str(exc)
    raise AssertionError(name)


def _observable(side: Side) -> Any:
    return (side.errors, side.drained, side.failures, side.near, side.calls, side.rec.next_serial,
            side.rec.pending_count, side.rec.totals(), _verdicts(side.rec.verdicts), len(side.rec.verdicts),
            side.rec.verdicts.watched_keys)


@SETTINGS
@given(ops=recorder_ops, drain_keys=st.sampled_from([3, 1000]))
def test_c_recorder_and_taps_behave_like_the_python_reference(ops: list[tuple[Any, ...]], drain_keys: int) -> None:
    ref = Side(PyRecorder, LookupVerdicts(6), drain_keys)
    fast = Side(C.Recorder, C.Verdicts(6), drain_keys)
    for op in ops:
        assert _run(ref, op) == _run(fast, op), op
        assert _observable(ref) == _observable(fast), op
    assert _plain_pending(ref.rec.take_pending()) == _plain_pending(fast.rec.take_pending())


@pytest.mark.parametrize("impl", ["python", "c"])
def test_a_tap_lets_the_inner_exception_through_untouched(impl: str) -> None:
    side = Side(PyRecorder if impl == "python" else C.Recorder,
                LookupVerdicts() if impl == "python" else C.Verdicts(), 1000)
    for tap in (side.lookup, side.store, side.finish, side.load, side.evict, side.allocate):
        boom = KeyError("vLLM's own")
        side.raise_ = boom
        args = (Context([]),) if tap is side.schedule_end else (KEYS[0], Ctx("a"))
        with pytest.raises(KeyError) as caught:
            tap(*args)
        assert caught.value is boom
    assert side.errors == [] and side.failures == []


@pytest.mark.parametrize("impl", ["python", "c"])
def test_the_load_tap_reraises_vllms_assertion_object_after_the_callback(impl: str) -> None:
    side = Side(PyRecorder if impl == "python" else C.Recorder,
                LookupVerdicts() if impl == "python" else C.Verdicts(), 1000)
    boom = AssertionError("Chunk x not found in cache")

    def explain(exc: BaseException, keys: Any, req: Any) -> None:
        exc.args = (f"{exc.args[0]} -- explained",)

    side.load = side.rec.load_tap(side._inner, explain, side._on_near)
    side.raise_ = boom
    with pytest.raises(AssertionError) as caught:
        side.load([KEYS[0]], Ctx("a"))
    assert caught.value is boom and str(boom).endswith("-- explained")
    assert caught.value.__traceback__ is not None


@pytest.mark.parametrize("impl", ["python", "c"])
def test_recording_faults_are_counted_never_raised(impl: str) -> None:
    side = Side(PyRecorder if impl == "python" else C.Recorder,
                LookupVerdicts() if impl == "python" else C.Verdicts(), 1000)
    side.result = HIT
    assert side.lookup(KEYS[0], object()) is HIT  # a request context without req_id
    side.result = [(KEYS[0], object())]  # a chunk without an id
    side.rec.keep_batches = 1
    assert side.evict(1, set()) is side.result
    side.result = "spec"
    boom = AssertionError("x")

    def broken(exc: BaseException, keys: Any, req: Any) -> None:
        raise RuntimeError("kvobs bug")

    load = side.rec.load_tap(side._inner, broken, side._on_near)
    side.raise_ = boom
    with pytest.raises(AssertionError) as caught:
        load([KEYS[0]], Ctx("a"))
    assert caught.value is boom
    assert [stage for stage, _ in side.errors] == ["record.lookup", "record.removal", "diagnosis"]


def _racing(background: Any, foreground: Any, done: Any) -> None:
    """Run ``foreground`` while ``background`` loops on another thread, switching threads every
    microsecond (so any window between two steps of a queue operation gets hit)."""
    import sys
    import threading

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=background)
    thread.start()
    try:
        foreground()
    finally:
        done.set()
        thread.join()
        sys.setswitchinterval(old)


def test_observer_with_c_taps_is_collected() -> None:
    """Taps and recorders take part in garbage collection: a dropped observer is freed."""
    from kvobs.observer import Observer

    observer = Observer()
    tap = observer.recorder.lookup_tap(observer.internal_error, 0, HIT, HIT_PENDING, False)
    observer.tap = tap  # type: ignore[attr-defined]  # a cycle through the tap
    ref = weakref.ref(observer)
    del observer, tap
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("impl", ["python", "c"])
def test_a_drain_on_another_thread_never_sees_a_half_queued_batch(impl: str) -> None:
    """The journal's writer drains while the scheduler thread queues: every run it takes is whole."""
    import threading

    recorder_cls, verdicts = (PyRecorder, LookupVerdicts()) if impl == "python" else (C.Recorder, C.Verdicts())
    rec = recorder_cls(verdicts, REASONS, 0, lambda stage, exc: None, lambda: None, lambda: 0, 10**9, 10**9)
    torn: list[Any] = []
    taken = [0]
    done = threading.Event()

    def writer() -> None:
        while not done.is_set() or rec.pending_count:
            _first, hashes, counts, times, flags, reqs, _records, _resets = rec.take_pending()
            n = len(reqs)
            if not (len(counts) == len(times) == len(flags) == 8 * n) or len(hashes) != 8 * 3 * n:
                torn.append((len(hashes), len(counts), len(times), len(flags), n))
            taken[0] += n

    def queue() -> None:
        for i in range(20_000):
            rec.removal(KEYS[:3], 0, None, float(i), 0, "r")

    _racing(writer, queue, done)
    assert torn == [] and taken[0] == 20_000


@pytest.mark.parametrize("impl", ["python", "c"])
def test_removals_off_the_tapped_thread_stay_in_serial_order_under_a_concurrent_drain(impl: str) -> None:
    """A removal with no tapped call above it asks Python for its path (the poll-thread check), where
    another thread may run; the queue it joins must still hand the history whole, ordered runs."""
    import threading

    from kvobs.history import EvictionHistory

    history = EvictionHistory(100_000)
    errors: list[str] = []
    recorder_cls, verdicts = (PyRecorder, LookupVerdicts()) if impl == "python" else (C.Recorder, C.Verdicts())

    def off_thread_path() -> int:
        return PATHS.index("poll_thread" if threading.current_thread().name == "poll" else "unobserved")

    rec = recorder_cls(verdicts, REASONS, 0, lambda stage, exc: errors.append(repr(exc)), lambda: None,
                       off_thread_path, 10**9, 10**9)
    lock = threading.Lock()
    done = threading.Event()

    def drain() -> None:
        with lock:
            first, hashes, counts, times, flags, reqs, _records, resets = rec.take_pending()
            try:
                history.record_columns(first, hashes, counts, times, flags, reqs, resets)
            except ValueError as exc:
                errors.append(str(exc))

    def drainer() -> None:
        while not done.is_set():
            drain()

    def queue() -> None:
        for i in range(20_000):
            rec.removal([i.to_bytes(8, "big")], 0, None, 1.0)

    _racing(drainer, queue, done)
    drain()
    assert errors == [] and history.next_serial == 20_000


@pytest.mark.parametrize("impl", ["python", "c"])
def test_a_request_context_of_none_and_a_renamed_one_are_recorded_as_they_are(impl: str) -> None:
    side = Side(PyRecorder if impl == "python" else C.Recorder,
                LookupVerdicts() if impl == "python" else C.Verdicts(), 1000)
    side.evict_in_store = [(KEYS[0], Chunk(0))]
    side.store([KEYS[0]], None)  # a removal under a call whose request context is None
    _first, _h, _c, _t, _f, reqs, _r, _resets = side.rec.take_pending()
    assert reqs == [None] and side.errors == []
    ctx = Ctx("a")
    side.result = HIT
    side.lookup(KEYS[1], ctx)
    ctx.req_id = "b"  # the same context object, renamed (vLLM's ReqContext is a mutable dataclass)
    side.lookup(KEYS[2], ctx)
    assert side.rec.verdicts.get("b", KEYS[2]) is not None and side.rec.verdicts.get("a", KEYS[2]) is None


@pytest.mark.parametrize("impl", ["python", "c"])
def test_an_interrupt_inside_kvobs_propagates_instead_of_being_counted(impl: str) -> None:
    recorder_cls, verdicts = (PyRecorder, LookupVerdicts()) if impl == "python" else (C.Recorder, C.Verdicts())
    errors: list[str] = []

    def drain() -> None:
        raise KeyboardInterrupt

    rec = recorder_cls(verdicts, REASONS, 4, lambda stage, exc: errors.append(stage), drain, lambda: 0, 1, 1)
    evict = rec.evict_tap(lambda n, protected: [(KEYS[0], Chunk(0))])
    with pytest.raises(KeyboardInterrupt):
        evict(1, set())
    assert errors == []
