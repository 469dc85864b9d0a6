"""The parameters of ``GET /api/v1/failures``: one rule per parameter, every one applied the same way.

Why a table: each parameter used to be checked by code of its own, and one (``before``) took any
text, so a typo or a path answered 200 with reports. Here every parameter has a rule that says
whether it may repeat and what a value must be, the same limits the journal's writer and reader
share (``kvobs.wire.format``); a value that breaks its rule is a :class:`QueryError` naming the parameter,
which the server answers with a 400. A value the API itself hands out (a ``next`` URL) always passes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from kvobs.codes import REPORT_CAUSES
from kvobs.wire.format import (
    ENGINE_LABEL_RULE,
    MAX_MODEL_NAME,
    REPORT_ID,
    is_engine_label,
    is_model_name,
    is_seconds,
    parse_integer,
)

MAX_FAILURES = 1_000
DEFAULT_FAILURES = 100
FAILURES_PATH = "/api/v1/failures"
"""The reports' endpoint; one report is at :func:`report_path`."""


def report_path(report_id: str) -> str:
    """Where the sidecar serves one report (``GET /api/v1/failures/<id>``): its log line names it."""
    return f"{FAILURES_PATH}/{report_id}"

MAX_FIELDS = 64
_NUMBER = re.compile(r"[0-9]{1,20}(?:\.[0-9]{1,20})?(?:[eE][+-]?[0-9]{1,3})?")
"""A plain decimal number (also as ``repr`` writes a float): no sign, ``_``, spaces, nan or inf."""


class QueryError(ValueError):
    """A bad /api/v1/failures query: a 400 with this message, naming ``parameter``."""

    def __init__(self, parameter: str, message: str) -> None:
        super().__init__(f"{parameter}: {message}")
        self.parameter = parameter


def _limit(text: str) -> int:
    value = parse_integer(text, 1, MAX_FAILURES)
    if value is None:
        raise ValueError(f"must be an integer in [1, {MAX_FAILURES}]")
    return value


def _engine(text: str) -> str:
    if not is_engine_label(text):
        raise ValueError(f"must be an engine label: {ENGINE_LABEL_RULE}")
    return text


def _model_name(text: str) -> str:
    if not is_model_name(text):  # "" is allowed: reports without a model name
        raise ValueError(f"must be at most {MAX_MODEL_NAME} printable characters")
    return text


def _cause(text: str) -> str:
    if text not in REPORT_CAUSES:
        raise ValueError(f"must be one of {', '.join(REPORT_CAUSES)}")
    return text


def _since(text: str) -> float:
    value = float(text) if _NUMBER.fullmatch(text) else -1.0
    if not is_seconds(value):
        raise ValueError("must be unix seconds: a non-negative decimal number")
    return value


def _before(text: str) -> str:
    if not REPORT_ID.fullmatch(text):
        raise ValueError("must be a report id as the API serves it (<15-digit ms time>-<engine>-<pid>-<n>)")
    return text


@dataclass(frozen=True)
class Rule:
    repeats: bool
    """Whether the parameter may be given more than once (any of its values then matches)."""
    parse: Callable[[str], Any]
    """The value, or ValueError saying what a value must be."""


RULES: dict[str, Rule] = {
    "limit": Rule(False, _limit),
    "engine": Rule(True, _engine),
    "model_name": Rule(True, _model_name),
    "cause": Rule(True, _cause),
    "since": Rule(False, _since),
    "before": Rule(False, _before),
}
PARAMETERS = tuple(RULES)


def parse_params(query: str) -> dict[str, list[Any]]:
    """Each parameter given in ``query``, its values parsed by its rule; :class:`QueryError` otherwise."""
    try:
        given = parse_qs(query, keep_blank_values=True, max_num_fields=MAX_FIELDS, errors="strict")
    except UnicodeDecodeError:
        raise QueryError("query", "is not UTF-8") from None
    except ValueError:
        raise QueryError("query", f"has more than {MAX_FIELDS} parameters") from None
    out: dict[str, list[Any]] = {}
    for name, values in given.items():
        rule = RULES.get(name)
        shown = name[:64]
        if rule is None:
            raise QueryError(shown, f"unknown parameter (parameters: {', '.join(PARAMETERS)})")
        if len(values) > 1 and not rule.repeats:
            raise QueryError(name, f"given {len(values)} times; give it once")
        parsed = []
        for value in values:
            try:
                parsed.append(rule.parse(value))
            except ValueError as exc:
                raise QueryError(name, f"{exc}; got {value[:80]!r}") from None
        out[name] = parsed
    return out
