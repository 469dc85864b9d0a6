"""Apply the same operations to a bare and an observed manager and compare everything.

Each operation returns a comparable outcome: the result (reduced to plain data),
or the exception's type and text. For the observed manager the text must *start
with* vLLM's (kvobs appends its explanation to prepare_load assertions only).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
    ScheduleEndContext,
)

from kvobs.vllm import compat
from tests.support.vllm_env import key


def plain(value: Any) -> Any:
    """Reduce vLLM results to data that compares by value."""
    if isinstance(value, PrepareStoreOutput):
        return ("store", list(value.keys_to_store), plain(value.store_spec), list(value.evicted_keys))
    if isinstance(value, BlockIDsLoadStoreSpec):
        return ("spec", type(value).__name__, value.block_ids.tolist())
    if hasattr(value, "data") and type(value).__name__.endswith("Stats"):
        return ("stats", stats_shape(value.data))
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


_TIMED = ("time", "latency", "delay")


def stats_shape(data: dict[str, Any]) -> Any:
    """Stats as comparable data; timing samples (wall-clock) compare by count only."""
    types, series = data["types"], data["data"]
    out = {}
    for name, by_labels in series.items():
        timed = any(word in name for word in _TIMED)
        out[name] = (
            types.get(name),
            {labels: (len(v) if isinstance(v, list) else None) if timed else v for labels, v in by_labels.items()},
        )
    return types, out, data.get("info")


@dataclass
class Outcome:
    value: Any = None
    error: tuple[type, str] | None = None


def run(call: Callable[[], Any]) -> Outcome:
    try:
        return Outcome(value=plain(call()))
    except Exception as exc:  # compared by the caller, not swallowed
        return Outcome(error=(type(exc), str(exc)))


@dataclass
class Twin:
    """One side of the comparison: a manager and its request contexts."""

    manager: OffloadingManager
    contexts: dict[str, ReqContext] = field(default_factory=dict)

    def ctx(self, req_id: str) -> ReqContext:
        if req_id not in self.contexts:
            self.contexts[req_id] = ReqContext(req_id)
        return self.contexts[req_id]


OPS = (
    "new_request", "lookup", "lookup", "lookup", "prepare_load", "complete_load", "prepare_store",
    "prepare_store", "complete_store", "finish", "schedule_end", "take_events", "get_stats", "reset",
    "touch", "has_pending_work",
)


def random_op(rng: random.Random, num_keys: int, num_requests: int) -> tuple[str, str, list[bytes], bool]:
    op = rng.choice(OPS)
    req = f"req-{rng.randrange(num_requests)}"
    keys = [key(rng.randrange(num_keys), group=rng.randrange(2)) for _ in range(rng.randint(1, 4))]
    return op, req, list(dict.fromkeys(keys)), rng.random() < 0.8


def step_lock(manager: Any) -> Any:
    """The manager's lock, held as vLLM holds it around a step (0.33; earlier releases have none)."""
    return manager.lock if compat.HAS_LOCK else contextlib.nullcontext()


def event_fields(event: Any) -> tuple[Any, ...]:
    """Everything an OffloadingEvent says, each field of whatever release runs (``metadata_only`` is
    0.33's; ``removal_expected`` and the request's ``req_context`` 0.34's): the request context as its
    ``req_id``, since the twins hold contexts of their own."""
    return tuple(
        getattr(value, "req_id", value) if field.name == "req_context" else value
        for field in dataclasses.fields(event)
        for value in (getattr(event, field.name),)
    )


def apply(twin: Twin, op: str, req: str, keys: list[bytes], flag: bool) -> Outcome:
    m, c = twin.manager, twin.ctx(req)
    with step_lock(m):
        match op:
            case "new_request":
                return run(lambda: m.on_new_request(c))
            case "lookup":
                return run(lambda: [m.lookup(k, c) for k in keys])
            case "prepare_load":
                return run(lambda: m.prepare_load(keys, c))
            case "complete_load":
                return run(lambda: m.complete_load(keys, c))
            case "prepare_store":
                return run(lambda: m.prepare_store(keys, c))
            case "complete_store":
                return run(lambda: m.complete_store(keys, c, flag))
            case "finish":
                return run(lambda: m.on_request_finished(c))
            case "schedule_end":
                return run(lambda: m.on_schedule_end(ScheduleEndContext(new_req_ids=[req], preempted_req_ids=())))
            case "take_events":
                return run(lambda: [event_fields(e) for e in m.take_events()])
            case "get_stats":
                return run(m.get_stats)
            case "reset":
                return run(m.reset_cache)
            case "touch":
                return run(lambda: m.touch(keys, c))
            case "has_pending_work":
                return run(m.has_pending_work)
    raise ValueError(op)


def same(bare: Outcome, observed: Outcome, op: str) -> bool:
    if bare.error is None or observed.error is None:
        return bare.error == observed.error and bare.value == observed.value
    (bare_type, bare_text), (obs_type, obs_text) = bare.error, observed.error
    if op == "prepare_load":
        return bare_type is obs_type and obs_text.startswith(bare_text)
    return bare_type is obs_type and obs_text == bare_text
