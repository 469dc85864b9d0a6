"""The recorder's taps: transparent to the caller, exact about what they record, never raising.

Driven with plain callables standing in for vLLM's methods (no vLLM needed); the integration
tests drive the same taps around vLLM's real managers. `make test` runs this file on the
compiled form and again on the Python form of the hot path.
"""

from __future__ import annotations

import copy
import gc
import pickle
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import pytest

from kvobs.codes import PATHS, unpack_flags
from kvobs.history import EvictionHistory
from kvobs.hot_path_loader import ClearTap, EvictTap, InsertTap, Recorder, RemoveTap

HIT, HIT_PENDING, MISS = object(), object(), object()
KEYS = [bytes([i]) * 36 for i in range(6)]
LOOKUP, STORE = PATHS.index("lookup"), PATHS.index("store")


@dataclass
class Ctx:
    req_id: str


@dataclass
class Chunk:
    chunk_id: int


class Harness:
    """A recorder with fake inner methods that log their calls."""

    def __init__(self, drain_keys: int = 10**9, num_stamps: int = 16) -> None:
        self.errors: list[tuple[str, BaseException]] = []
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.result: Any = None
        self.raise_: BaseException | None = None
        self.failures: list[Any] = []
        self.rec = Recorder(
            max_verdicts=100, num_stamps=num_stamps, on_error=lambda s, e: self.errors.append((s, e)),
            drain_keys=drain_keys, drain_batches=10**9,
        )
        self.near = self.rec.near  # what the observer settles (Observer.drain)
        self.lookup = self.rec.lookup_tap(self.inner, path=LOOKUP, hit=HIT, hit_pending=HIT_PENDING, marks_frame=True)
        self.store = self.rec.keys_tap(self.inner, path=STORE, name="prepare_store")
        self.finish = self.rec.request_tap(self.inner, path=PATHS.index("schedule_end"))
        self.load = self.rec.load_tap(self.inner, on_failure=lambda e, k, r: self.failures.append((e, k, r)))
        self.evict = EvictTap(self.rec, self.inner)

    def inner(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((args, kwargs))
        if self.raise_ is not None:
            raise self.raise_
        return self.result


def test_taps_forward_the_callers_arguments_and_return_the_result() -> None:
    """Arguments vLLM's methods take by name arrive by position; any other keyword as given."""
    h = Harness()
    ctx = Ctx("a")
    for tap, args, kwargs, received in (
        (h.lookup, (KEYS[0],), {"req_context": ctx, "exclude_tier_idx": 1},
         ((KEYS[0], ctx), {"exclude_tier_idx": 1})),
        (h.store, (KEYS[:2], ctx), {}, ((KEYS[:2], ctx), {})),
        (h.store, (KEYS[:2], ctx, False), {}, ((KEYS[:2], ctx, False), {})),  # complete_store(keys, ctx, success)
        (h.load, (), {"keys": [KEYS[0]], "req_context": ctx}, (([KEYS[0]], ctx), {})),
        (h.finish, (ctx,), {"exclude_tier_idx": 0}, ((ctx,), {"exclude_tier_idx": 0})),
        (h.evict, (2, set()), {}, ((2, set()), {})),
    ):
        h.calls.clear()
        h.result = [] if tap is h.evict else object()
        assert tap(*args, **kwargs) is h.result
        assert h.calls == [received]
    assert h.errors == []


def test_a_tap_lets_the_inner_exception_through_untouched() -> None:
    h = Harness()
    for tap, args in ((h.lookup, (KEYS[0], Ctx("a"))), (h.store, ([KEYS[0]], Ctx("a"))), (h.finish, (Ctx("a"),)),
                      (h.load, ([KEYS[0]], Ctx("a"))), (h.evict, (1, set()))):
        boom = h.raise_ = KeyError("vLLM's own")
        with pytest.raises(KeyError) as caught:
            tap(*args)
        assert caught.value is boom
    assert h.errors == [] and h.failures == []


def test_the_load_tap_reraises_vllms_assertion_object_after_the_callback() -> None:
    h = Harness()
    boom = h.raise_ = AssertionError("Chunk x not found in cache")

    def explain(exc: AssertionError, keys: Any, req: Any) -> None:
        exc.args = (f"{exc.args[0]} -- explained",)

    load = h.rec.load_tap(h.inner, on_failure=explain)
    with pytest.raises(AssertionError) as caught:
        load([KEYS[0]], Ctx("a"))
    assert caught.value is boom and str(boom).endswith("-- explained") and boom.__traceback__ is not None


def test_lookups_make_promises_and_a_removal_in_a_store_breaks_them() -> None:
    h = Harness()
    h.result = HIT
    h.lookup(KEYS[0], Ctx("a"))
    h.result = HIT_PENDING
    h.lookup(KEYS[1], Ctx("a"))
    h.result = MISS
    h.lookup(KEYS[2], Ctx("a"))
    assert h.rec.promises.verdict("a", KEYS[0]) is None  # captured, not yet applied
    assert h.rec.apply_all() == 3
    assert [h.rec.promises.verdict("a", k) is not None for k in KEYS[:3]] == [True, True, False]
    assert h.rec.promises.verdict("a", KEYS[1]).pending  # type: ignore[union-attr]

    def store_that_evicts(keys: Any, ctx: Any) -> str:  # capacity eviction inside prepare_store
        h.result = [(KEYS[0], Chunk(3))]
        h.evict(1, set())
        return "stored"

    store = h.rec.keys_tap(store_that_evicts, path=STORE, name="prepare_store")
    assert store([KEYS[4]], Ctx("b")) == "stored"
    h.rec.apply_all()
    run = h.rec.take_run()
    assert list(run.reqs) == ["b"] and unpack_flags(run.flags[0]) == (0, STORE)
    h.result = "spec"
    assert h.load([KEYS[0], KEYS[1]], Ctx("a")) == "spec"
    assert h.near == [] and h.rec.apply_all() == 1
    ((req_id, [(key, verdict, decided)]),) = h.near  # the observer asks the history which removal broke it
    assert (req_id, key, verdict.pending, decided) == ("a", KEYS[0], False, True)


def test_removals_off_the_tapped_thread_get_the_off_thread_path() -> None:
    h = Harness()
    h.rec.frame = (STORE, Ctx("a"), threading.get_ident() + 1)  # a tapped call running on another thread
    h.result = [(KEYS[0], Chunk(0))]
    h.evict(1, set())
    h.rec.apply_all()
    run = h.rec.take_run()
    assert unpack_flags(run.flags[0])[1] == PATHS.index("unobserved") and list(run.reqs) == [None]


def test_residency_is_kept_only_while_a_sink_needs_it() -> None:
    h = Harness()
    h.result = [(KEYS[0], Chunk(1))]
    h.evict(1, set())
    h.rec.apply_all()
    run = h.rec.take_run()
    assert run.keys == [KEYS[0]] and run.residency is None
    h.rec.keep_residency = True
    insert = InsertTap(h.rec, lambda key, chunk, ctx: None)
    insert(KEYS[0], Chunk(1), Ctx("a"))
    h.result = [(KEYS[0], Chunk(1)), (KEYS[1], Chunk(99))]  # slot 99 was never stamped
    h.evict(2, set())
    h.rec.apply_all()
    run = h.rec.take_run()
    assert run.keys == [KEYS[0], KEYS[1]] and run.residency is not None
    assert run.residency[0] >= 0 and run.residency[1] != run.residency[1]  # NaN: unknown


def test_the_apply_stops_for_a_fold_when_the_queue_is_full() -> None:
    h = Harness(drain_keys=4)
    h.result = [(k, Chunk(i)) for i, k in enumerate(KEYS[:2])]
    h.evict(2, set())
    h.evict(2, set())
    h.evict(2, set())
    assert h.rec.apply_all() == 2  # the second filled the queue: the observer folds before the third applies
    assert h.rec.pending == 2 and h.rec.captured == 1
    run = h.rec.take_run()
    assert (run.first_serial, list(run.counts)) == (0, [2, 2]) and h.rec.pending == 0
    h.evict(2, set())
    h.rec.apply_all()
    assert h.rec.take_run().first_serial == 2


def test_recording_faults_are_counted_never_raised() -> None:
    h = Harness()
    h.result = HIT
    assert h.lookup(KEYS[0], object()) is HIT  # a request context without req_id
    h.rec.apply_all()  # where the lookup is recorded, and faults
    h.rec.keep_residency = True
    h.result = [(KEYS[0], object())]  # a chunk without an id
    assert h.evict(1, set()) is h.result
    boom = h.raise_ = AssertionError("x")

    def broken(exc: BaseException, keys: Any, req: Any) -> None:
        raise RuntimeError("kvobs bug")

    load = h.rec.load_tap(h.inner, on_failure=broken)
    with pytest.raises(AssertionError) as caught:
        load([KEYS[0]], Ctx("a"))
    assert caught.value is boom
    assert [stage for stage, _ in h.errors] == ["record.lookup", "record.removal", "diagnosis"]


def test_an_interrupt_inside_kvobs_propagates_instead_of_being_counted() -> None:
    errors: list[str] = []

    def drain() -> None:
        raise KeyboardInterrupt

    rec = Recorder(max_verdicts=10, num_stamps=0, on_error=lambda s, e: errors.append(s), on_apply=drain,
                   capture_wake=1, capture_limit=1)
    evict = EvictTap(rec, lambda n, protected: [(KEYS[0], Chunk(0))])
    with pytest.raises(KeyboardInterrupt):
        evict(1, set())  # the buffer at its limit: applied by the capturing thread, through the observer's drain
    assert errors == []


class Policy:
    """A picklable stand-in for vLLM's cache policy, hooked the way kvobs hooks the real one."""

    def __init__(self) -> None:
        self.chunks: dict[bytes, Chunk] = {KEYS[0]: Chunk(0)}
        self.evicted = 0

    def evict(self, n: int, protected: Any) -> list[tuple[bytes, Chunk]]:
        self.evicted += n
        return [(KEYS[0], Chunk(0))]

    def remove(self, key: bytes) -> None:
        self.chunks.pop(key, None)

    def clear(self) -> None:
        self.chunks.clear()


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_or_pickled_policy_gets_its_plain_methods_back(how: str) -> None:
    h = Harness()
    policy = Policy()
    policy.evict = EvictTap(h.rec, policy.evict)  # type: ignore[method-assign]
    policy.remove = RemoveTap(h.rec, policy.remove, policy.chunks.get)  # type: ignore[method-assign]
    policy.clear = ClearTap(h.rec, policy.clear, lambda: list(policy.chunks.items()))  # type: ignore[method-assign]
    twin = copy.deepcopy(policy) if how == "deepcopy" else pickle.loads(pickle.dumps(policy))
    twin.evict(1, set())
    twin.remove(KEYS[0])
    twin.clear()
    assert (twin.evicted, policy.evicted) == (1, 0)  # the copy evicts from itself, never from the original
    assert h.rec.captured == 0  # and records nothing into the original's recorder
    policy.evict(1, set())
    assert h.rec.captured == 1


def test_a_dropped_observer_is_collected() -> None:
    from kvobs.observer import Observer

    observer = Observer()
    tap = observer.recorder.lookup_tap(observer.internal_error, path=0, hit=HIT, hit_pending=HIT_PENDING,
                                       marks_frame=False)
    observer.tap = tap  # type: ignore[attr-defined]  # a cycle through the tap
    ref = weakref.ref(observer)
    del observer, tap
    gc.collect()
    assert ref() is None


def _racing(background: Any, foreground: Any, done: threading.Event) -> None:
    """Run ``foreground`` while ``background`` loops on another thread, switching threads every microsecond."""
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


def test_a_drain_on_another_thread_never_sees_a_half_queued_batch() -> None:
    """The applier (or the journal's writer) applies and drains while the scheduler thread captures: no
    capture is lost and every run it takes is whole."""
    h = Harness()
    history = EvictionHistory(100_000)
    torn: list[str] = []
    done = threading.Event()

    def writer() -> None:
        while not done.is_set() or h.rec.captured or h.rec.pending:
            h.rec.apply_all()  # the applier's part: captures taken off while the scheduler thread appends
            run = h.rec.take_run()
            try:
                history.record_columns(run.first_serial, run.hashes, run.counts, run.times, run.flags, run.reqs)
            except ValueError as exc:
                torn.append(str(exc))

    def queue() -> None:
        for i in range(20_000):
            h.rec.removal(KEYS[:3], 0, None, float(i), path=0, req_id="r")

    _racing(writer, queue, done)
    assert torn == [] and history.next_serial == 20_000
