"""Transparency under random workloads: hypothesis drives a bare and a kvobs-wrapped manager.

Builds on twin_driver (the seeded version in tests/integration/test_transparency.py):
hypothesis generates operation lists over a small key space (so stores evict and
loads fail), shrinks any difference to a minimal sequence, and covers the calls
the seeded driver leaves out (get_load_source, on_reset_flushed, config_info,
tiering's ``exclude_tier_idx``, schedule ends with preemptions). Every operation's
result or exception must match (prepare_load: same type, vLLM's text as prefix),
and at the end of each sequence the remaining events, the stats and the cache
policy's contents must match too. One configuration also runs kvobs's sinks
(journal + a real SDK tracer) to show that they do not perturb vLLM either.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from vllm.v1.kv_offload.base import ScheduleEndContext

import kvobs
from kvobs.vllm import compat
from kvobs.vllm.compat import resident_chunks
from tests.support.figures import COUNTS
from tests.support.twin_driver import Outcome, Twin, apply, event_fields, plain, run, same, step_lock
from tests.support.vllm_env import cpu_extra, create_manager, key, tiering_extra

MAX_EXAMPLES = 150
MAX_OPS = 80
MIN_OPS = 15
NUM_KEYS = 10
NUM_REQUESTS = 3

DRIVER_OPS = (
    "new_request", "lookup", "prepare_load", "complete_load", "prepare_store", "complete_store", "finish",
    "schedule_end", "take_events", "get_stats", "reset", "touch", "has_pending_work",
)
EXTRA_OPS = ("get_load_source", "reset_flushed", "config_info", "lookup_excluding", "schedule_end_preempted")
# Weighted towards the calls that move chunks in and out.
OP_WEIGHTS = (
    *DRIVER_OPS, "lookup", "lookup", "prepare_store", "prepare_store", "prepare_load", "complete_store",
    "complete_store", *EXTRA_OPS,
)

keys_strategy = st.lists(
    st.tuples(st.integers(0, NUM_KEYS - 1), st.integers(0, 1)), min_size=1, max_size=5, unique=True
)
op_strategy = st.tuples(
    st.sampled_from(OP_WEIGHTS), st.integers(0, NUM_REQUESTS - 1), keys_strategy, st.booleans()
)
ops_strategy = st.lists(op_strategy, min_size=MIN_OPS, max_size=MAX_OPS)

CONFIGS: dict[str, dict[str, Any]] = {
    "cpu-lru": cpu_extra(5, _events=True),
    "cpu-arc": cpu_extra(5, eviction_policy="arc", _events=True),
    "tiering": tiering_extra(5, _events=True),
    "cpu-lru+sinks": cpu_extra(4, _events=True),
}

# Exporter threads left retrying by the tracing fault tests (the OTLP exporter's backoff jitter
# uses the global `random`) make hypothesis warn that strategies used `random`; they do not.
pytestmark = pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisDeprecationWarning")

PROPERTY = settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def apply_extra(twin: Twin, op: str, req: str, keys: list[bytes], flag: bool, tiering: bool) -> Outcome:
    """The calls twin_driver.apply does not make."""
    m, c = twin.manager, twin.ctx(req)
    with step_lock(m):
        match op:
            case "get_load_source":
                return run(lambda: [m.get_load_source(k, c) for k in keys])
            case "reset_flushed":
                return run(lambda: m.on_reset_flushed())
            case "config_info":
                return run(lambda: [dict(i) if isinstance(i, dict) else repr(i) for i in m.config_info()])
            case "lookup_excluding":
                if tiering:
                    return run(lambda: [m.lookup(k, c, exclude_tier_idx=0) for k in keys])
                return run(lambda: [m.lookup(k, c) for k in keys])
            case "schedule_end_preempted":
                end = ScheduleEndContext(new_req_ids=[] if flag else [req], preempted_req_ids=[req])
                return run(lambda: m.on_schedule_end(end))
    raise ValueError(op)


def final_state(twin: Twin) -> Any:
    """Everything observable after a sequence: remaining events, stats, the policy's contents."""
    m = twin.manager
    with step_lock(m):
        events = [event_fields(e) for e in m.take_events()]
        stats = plain(m.get_stats())
        inner = getattr(m, "inner", m)
        cpu = getattr(inner, "primary_tier", inner)
        chunks = sorted((k, c.chunk_id, c.ref_cnt, c.is_ready) for k, c in resident_chunks(cpu._policy))
        return events, stats, chunks, m.has_pending_work()


Ops = list[tuple[str, int, list[tuple[int, int]], bool]]
METHODS = {"finish": "on_request_finished", "schedule_end": "on_schedule_end", "reset": "reset_cache"}
"""The manager method an op of tests/support/twin_driver.py calls, where its name differs."""


def check_sequence(config: str, ops: Ops, directory: Path | None) -> None:
    extra = CONFIGS[config]
    tiering = "secondary_tiers" in extra
    exporter = InMemorySpanExporter()
    options: dict[str, Any] = {}
    if directory is not None:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        options = {"dir": str(directory), "tracer_provider": provider, "history_size": 1024}
    bare = Twin(create_manager(dict(extra)))
    observed = kvobs.observe(create_manager(dict(extra)), **options)
    wrapped = Twin(observed)
    failed_loads = 0
    raised = []  # exceptions out of a tapped call (the recorder, on by default, taps each of CALL_ARGS): one span each
    try:
        for step, (op, r, key_ids, flag) in enumerate(ops):
            req = f"req-{r}"
            keys = [key(i, group=g) for i, g in key_ids]
            if op in EXTRA_OPS:
                expected = apply_extra(bare, op, req, keys, flag, tiering)
                got = apply_extra(wrapped, op, req, keys, flag, tiering)
            else:
                expected, got = apply(bare, op, req, keys, flag), apply(wrapped, op, req, keys, flag)
            assert same(expected, got, op), (step, op, req, key_ids, flag, expected, got)
            method = METHODS.get(op, op)
            if got.error is not None and method in compat.CALL_ARGS and hasattr(bare.manager, method):
                raised.append((op, got.error[0].__name__))
            if op == "prepare_load" and got.error is not None:
                failed_loads += 1
                if got.error[0] is AssertionError:
                    assert "cause: " in got.error[1]  # kvobs explained it
        assert final_state(bare) == final_state(wrapped)
        obs = observed.observer
        assert not +obs.internal_errors, obs.internal_errors
        # Every failed load was diagnosed exactly once; with sinks, every exception spanned once (a failed
        # load's span, or the boundary's of another call: kvobs/vllm/boundary.py, side manager).
        assert sum(obs.failures.values()) == failed_loads
        if directory is not None:
            spans = exporter.get_finished_spans()
            assert len(spans) == len(raised), ([s.name for s in spans], raised)
    finally:
        bare.manager.shutdown()
        observed.shutdown()
    COUNTS[f"transparency.{config}.sequences"] += 1
    COUNTS[f"transparency.{config}.operations"] += len(ops)
    COUNTS[f"transparency.{config}.failed_loads"] += failed_loads


@pytest.mark.slow
@pytest.mark.parametrize("config", ["cpu-lru", "cpu-arc", "tiering"])
def test_random_operation_lists_are_transparent(config: str) -> None:
    @PROPERTY
    @given(ops=ops_strategy)
    def prop(ops: Ops) -> None:
        check_sequence(config, ops, None)

    before = COUNTS[f"transparency.{config}.failed_loads"]
    prop()
    assert COUNTS[f"transparency.{config}.failed_loads"] > before  # the failure path was reached


def test_random_operation_lists_are_transparent_with_journal_and_tracer(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    @settings(PROPERTY, max_examples=MAX_EXAMPLES // 3)
    @given(ops=ops_strategy)
    def prop(ops: Ops) -> None:
        check_sequence("cpu-lru+sinks", ops, tmp_path_factory.mktemp("kvobs"))

    prop()
    assert COUNTS["transparency.cpu-lru+sinks.failed_loads"] > 0
