"""Why a load found chunks missing: classify each key, then write the message.

Pure logic: it sees facts gathered by the observer (each key's promise and the removal
that broke it, by the rule in ``kvobs/hot_promises.py``; its last recorded removal; its
state in the cache) and imports nothing from vLLM, so it is tested without vLLM and
runs in the failing process in microseconds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvobs import message
from kvobs.codes import CAUSE_OF_REASON, CAUSES
from kvobs.history import Removal

if TYPE_CHECKING:
    from kvobs.hot_path_loader import Verdict

__all__ = ["CAUSES", "Diagnosis", "KeyDiagnosis", "KeyFacts", "LoadFailure", "classify", "diagnose"]

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
    verdict: Verdict | None  # this request's promise for the key (its lookup's positive answer), if any
    last_removal: Removal | None  # the key's most recent recorded removal
    breach: str | None = None  # reason of the first removal after the promise (it broke the promise)
    breaking_removal: Removal | None = None  # that removal's details, while the history holds them
    verdicts_dropped: bool = False  # some of this request's promises did not fit (max_verdicts)
    expected_tier: str | None = None  # the tier the load expected it in, vLLM's CacheHitSource value, if known


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
    recomputed: bool = False  # survive mode: vLLM recomputes the load instead of the engine dying


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
    """The cause of one unloadable key (DESIGN.md, "Causes")."""
    if facts.state == NOT_READY:
        return "store_in_flight"
    if facts.verdict is None:  # never promised, unless the promise was among the dropped ones
        return "unknown" if facts.verdicts_dropped else "coverage_mismatch"
    if facts.breach is not None:
        return CAUSE_OF_REASON[facts.breach]
    return "unknown"


def _age(removal: Removal | None, now: float) -> float | None:
    return None if removal is None else round(max(0.0, now - removal.time), 3)


def _seconds(value: float) -> float:
    return round(max(0.0, value), 3)


def _by(removal: Removal) -> str:
    return f"path={removal.path}" + (f", req_id={removal.req_id!r}" if removal.req_id else "")


def _evidence(facts: KeyFacts, cause: str, now: float) -> str:
    verdict = facts.verdict
    last = facts.last_removal
    if cause == "store_in_flight":
        return "the chunk is in the cache but its store has not completed"
    if verdict is None:
        seen = f"last removed {_age(last, now)}s ago ({last.reason})" if last is not None else "no removal recorded"
        if facts.verdicts_dropped:
            return (f"lookup verdicts of this request were dropped (max_verdicts reached), so whether its lookup "
                    f"reported the chunk is not known; {seen}")
        return f"this request's lookups never reported the chunk; {seen}"
    said = "HIT_PENDING" if verdict.pending else "HIT"
    looked = f"lookup reported {said} {_seconds(now - verdict.time)}s before the load"
    if facts.breach is not None:
        breaking = facts.breaking_removal
        if breaking is None:
            text = f"{looked}; {facts.breach} removal after the lookup (its details are older than the history)"
        else:
            after = _seconds(breaking.time - verdict.time)
            text = f"{looked}; {breaking.reason} removal {after}s after the lookup, {_by(breaking)}"
        if last is not None and (breaking is None or last.serial > breaking.serial):
            text += f"; removed again since: {last.reason} {_age(last, now)}s ago, {_by(last)}"
        return text
    if last is not None:
        return f"{looked}; no removal broke that promise (the last recorded one, {last.reason}, came before it)"
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
    """vLLM's text, then the fields of DESIGN.md's message (``kvobs.message``), then the cause."""
    failure = diagnosis.failure
    group = failure.failing_group
    if group is None and diagnosis.keys:
        group = diagnosis.keys[0].facts.group
    listed = [(k.facts.end_token, k.age_s) for k in diagnosis.keys[:MAX_LISTED_KEYS]]
    more = len(diagnosis.keys) - len(listed)
    return message.render(
        failure.vllm_message,
        group=group,
        req_id=failure.req_id,
        missing=len(diagnosis.keys),
        keys=failure.num_keys,
        listed=listed,
        more=more if more > 0 else None,
        end_token_range=failure.end_token_range,
        history_keys=failure.history_keys,
        history_window_s=failure.history_window_s,
        cause=diagnosis.cause,
        evidence=diagnosis.keys[0].evidence if diagnosis.keys else "no missing key was identified",
        causes=diagnosis.causes if len(diagnosis.causes) > 1 else None,
    )
