"""Why a load found chunks missing: classify each key, then write the message.

Pure logic: it sees facts gathered by the glue (lookup verdicts, last removals,
chunk states) and imports nothing from vLLM, so it is tested without vLLM and
runs in the failing process in microseconds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvobs.history import Removal
from kvobs.verdicts import Verdict

CAUSES: tuple[str, ...] = (
    "evicted_after_lookup",
    "reset_after_lookup",
    "store_failed_after_lookup",
    "coverage_mismatch",
    "store_in_flight",
    "unknown",
)
"""Every cause a missing key can have (also the ``cause`` label values)."""

_CAUSE_OF_REASON = {
    "capacity": "evicted_after_lookup",
    "reset": "reset_after_lookup",
    "store_failed": "store_failed_after_lookup",
}

MAX_LISTED_KEYS = 16

MISSING = "missing"
NOT_READY = "not_ready"


@dataclass(frozen=True, slots=True)
class KeyFacts:
    """What kvobs knows about one key of a failed load that is not loadable."""

    key: bytes
    group: int
    end_token: int | None
    state: str  # MISSING or NOT_READY
    verdict: Verdict | None  # this request's positive lookup answer, if any
    last_removal: Removal | None
    reset_after_lookup: Removal | None = None  # a reset batch with no keys listed
    verdicts_dropped: bool = False  # some of this request's verdicts did not fit (max_verdicts)


@dataclass(frozen=True, slots=True)
class LoadFailure:
    """Everything the message and the reports are built from."""

    vllm_message: str
    req_id: str
    num_keys: int
    end_token_range: tuple[int, int] | None
    missing: Sequence[KeyFacts]
    history_keys: int
    history_window_s: float
    now: float
    failing_group: int | None = None
    trace_headers: Mapping[str, str] | None = None  # the request's W3C trace context, if carried


@dataclass(frozen=True, slots=True)
class KeyDiagnosis:
    facts: KeyFacts
    cause: str
    age_s: float | None  # seconds since the key's last recorded removal
    evidence: str


@dataclass(frozen=True, slots=True)
class Diagnosis:
    failure: LoadFailure
    keys: Sequence[KeyDiagnosis]
    cause: str  # the first key's cause
    causes: dict[str, int] = field(default_factory=dict)

    @property
    def message(self) -> str:
        return format_message(self)


def classify(facts: KeyFacts) -> str:
    """The cause of one unloadable key (see the table in DESIGN.md)."""
    if facts.state == NOT_READY:
        return "store_in_flight"
    verdict = facts.verdict
    if verdict is None:  # never reported, unless the report was among the dropped verdicts
        return "unknown" if facts.verdicts_dropped else "coverage_mismatch"
    removal = facts.last_removal
    if removal is not None and removal.serial >= verdict.serial:
        return _CAUSE_OF_REASON[removal.reason]
    if facts.reset_after_lookup is not None:
        return "reset_after_lookup"
    return "unknown"


def _age(removal: Removal | None, now: float) -> float | None:
    return None if removal is None else round(max(0.0, now - removal.time), 3)


def _evidence(facts: KeyFacts, cause: str, now: float) -> str:
    verdict = facts.verdict
    if cause == "store_in_flight":
        return "the chunk is in the cache but its store has not completed"
    if verdict is None:
        seen = (
            f"last removed {_age(facts.last_removal, now)}s ago ({facts.last_removal.reason})"
            if facts.last_removal is not None
            else "no removal recorded"
        )
        if facts.verdicts_dropped:
            return (f"lookup verdicts of this request were dropped (max_verdicts reached), so whether its lookup "
                    f"reported the chunk is not known; {seen}")
        return f"this request's lookups never reported the chunk; {seen}"
    said = "HIT_PENDING" if verdict.pending else "HIT"
    looked = f"lookup reported {said} {round(max(0.0, now - verdict.time), 3)}s before the load"
    removal = facts.last_removal
    if removal is not None and removal.serial >= verdict.serial:
        by = f", req_id={removal.req_id!r}" if removal.req_id else ""
        return (
            f"{looked}; {removal.reason} removal {round(max(0.0, removal.time - verdict.time), 3)}s"
            f" after the lookup, path={removal.path}{by}"
        )
    if facts.reset_after_lookup is not None:
        reset = facts.reset_after_lookup
        return f"{looked}; reset_cache() {round(max(0.0, reset.time - verdict.time), 3)}s after the lookup"
    if removal is not None:
        return f"{looked}; its last recorded removal came before the lookup"
    return f"{looked}; no removal recorded (older than the history, or an unobserved path)"


def diagnose(failure: LoadFailure) -> Diagnosis:
    """Classify every unloadable key; the load's cause is the first key's."""
    keys = []
    for facts in failure.missing:
        cause = classify(facts)
        keys.append(
            KeyDiagnosis(
                facts=facts,
                cause=cause,
                age_s=_age(facts.last_removal, failure.now),
                evidence=_evidence(facts, cause, failure.now),
            )
        )
    cause = keys[0].cause if keys else "unknown"
    return Diagnosis(failure=failure, keys=keys, cause=cause, causes=dict(Counter(k.cause for k in keys)))


def format_message(diagnosis: Diagnosis) -> str:
    """vLLM's text, then the fields of DESIGN.md's message, then the cause."""
    failure = diagnosis.failure
    group = failure.failing_group
    if group is None and diagnosis.keys:
        group = diagnosis.keys[0].facts.group
    listed = [(k.facts.end_token, k.age_s) for k in diagnosis.keys[:MAX_LISTED_KEYS]]
    more = len(diagnosis.keys) - len(listed)
    listed_text = repr(listed) + (f" (+{more} more)" if more > 0 else "")
    token_range = (
        f"{failure.end_token_range[0]}-{failure.end_token_range[1]}"
        if failure.end_token_range is not None
        else "unknown"
    )
    first = diagnosis.keys[0].evidence if diagnosis.keys else "no missing key was identified"
    text = (
        f"{failure.vllm_message} (group={group}, req_id={failure.req_id!r}). "
        f"{len(diagnosis.keys)} of {failure.num_keys} keys in this load are missing. "
        f"(end_token, seconds since eviction) per missing key: {listed_text}; "
        f"load end_token range: {token_range}; "
        f"eviction history: {failure.history_keys} keys over {round(failure.history_window_s, 1)}s. "
        f"cause: {diagnosis.cause} ({first})"
    )
    if len(diagnosis.causes) > 1:
        per_cause = ", ".join(f"{c}={n}" for c, n in sorted(diagnosis.causes.items()))
        text += f"; causes per key: {per_cause}"
    return text
