"""kvobs's part of the failure message, defined once: to write it and to read it back.

On a failed load the assertion's text is vLLM's own, then kvobs's (DESIGN.md, "The message")::

    Chunk b'...' not found in cache (group=5, req_id='req-a'). 1 of 1 keys in this load are missing.
    (end_token, seconds since eviction) per missing key: [(1024, 0.0)]; load end_token range: 1024-1024;
    eviction history: 1 keys over 0.0s. cause: evicted_after_lookup (...evidence...)

:data:`SUFFIX`, :data:`BODY` and :data:`CAUSE` list kvobs's parts in order: literal text, and fields
(:class:`Field`: each with its name, how its value is written, and the pattern the written text
matches), some of them in a :class:`Maybe` that is written only when its fields have values.
:func:`render` writes the message from these parts (``kvobs.diagnosis``); the regular expressions
``kvobs explain`` reads logs with (:data:`SUFFIX_RE`, :data:`CAUSE_RE`, and :data:`MESSAGE_RE` for the
whole) are compiled from the same parts: the literal text escaped, each field replaced by its
pattern as a group named after it. vLLM's own text, before them, is vLLM's: explain finds it by its
wordings (``kvobs.explain.ASSERTION``).

Change the message here, and both sides change; tests/unit/test_message.py writes messages and
reads them back, field for field. Standard library only: ``kvobs explain`` and the sidecar import it
without the engine's modules.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BODY", "CAUSE", "CAUSE_RE", "FIELDS", "MESSAGE", "MESSAGE_RE", "SUFFIX", "SUFFIX_RE", "Field", "Maybe",
           "pattern", "read", "render"]

INT = r"-?\d+"
COUNT = r"\d+"
FLOAT = r"-?(?:\d+(?:\.\d+)?(?:e[+-]\d+)?|inf|nan)"
"""``repr()`` of a float: 0.5, 1e-05, 1.5e+16, inf, nan."""
STR_LITERAL = r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\""
"""``repr()`` of a str."""
CAUSE_NAME = r"[a-z_]+"
_KEY_ITEM = rf"\((?:{INT}|None), (?:{FLOAT}|None)\)"


@dataclass(frozen=True, slots=True)
class Field:
    """One field of the message: its name (also its group's in the regexes), the pattern its written
    text matches, and how its value is written (``format``: as an f-string writes it)."""

    name: str
    pattern: str
    write: Callable[[Any], str] = format


@dataclass(frozen=True, slots=True)
class Maybe:
    """Parts written only when every field among them has a value (not None); optional when read."""

    parts: tuple[Part, ...]
    fields: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "fields", tuple(f.name for f in _fields(self.parts)))


Part = str | Field | Maybe


def _fields(parts: Sequence[Part]) -> Iterator[Field]:
    for part in parts:
        if isinstance(part, Field):
            yield part
        elif isinstance(part, Maybe):
            yield from _fields(part.parts)


def _end_token_range(value: tuple[int, int] | None) -> str:
    return "unknown" if value is None else f"{value[0]}-{value[1]}"


def _tenths(seconds: float) -> str:
    return f"{round(seconds, 1)}"


def _per_cause(causes: Mapping[str, int]) -> str:
    return ", ".join(f"{c}={n}" for c, n in sorted(causes.items()))


SUFFIX: tuple[Part, ...] = (
    " (group=", Field("group", rf"{INT}|None"), ", req_id=", Field("req_id", rf"{STR_LITERAL}|None", repr), ")",
)
"""Right after vLLM's text: the load's KV-cache group and its request."""
BODY: tuple[Part, ...] = (
    ". ", Field("missing", COUNT), " of ", Field("keys", COUNT), " keys in this load are missing. ",
    "(end_token, seconds since eviction) per missing key: ",
    Field("listed", rf"\[(?:{_KEY_ITEM}(?:, {_KEY_ITEM})*)?\]", repr), Maybe((" (+", Field("more", COUNT), " more)")),
    "; load end_token range: ", Field("end_token_range", rf"{INT}-{INT}|unknown", _end_token_range),
    "; eviction history: ", Field("history_keys", COUNT), " keys over ", Field("history_window_s", FLOAT, _tenths),
    "s. ",
)
"""The counts: missing keys of the load, the first ones listed, its end tokens, the history's extent."""
CAUSE: tuple[Part, ...] = (
    "cause: ", Field("cause", CAUSE_NAME), " (", Field("evidence", r"[^\n]*"), ")",
    Maybe(("; causes per key: ", Field("causes", rf"{CAUSE_NAME}={COUNT}(?:, {CAUSE_NAME}={COUNT})*", _per_cause))),
)
"""The load's cause (its first key's) and that key's evidence, then each cause's count when there are several."""
MESSAGE: tuple[Part, ...] = SUFFIX + BODY + CAUSE
END = r"\s*$"
"""The message ends its line. So the evidence ends at the line's last ``)`` before the counts per cause
(which hold none), and evidence that holds ``); `` itself (a request id, a removal's details) is read whole."""


FIELDS: dict[str, Field] = {f.name: f for f in _fields(MESSAGE)}
assert len(FIELDS) == len(list(_fields(MESSAGE))), "a field name is used twice"


def _write(parts: Sequence[Part], values: Mapping[str, object], out: list[str]) -> None:
    for part in parts:
        if isinstance(part, str):
            out.append(part)
        elif isinstance(part, Field):
            out.append(part.write(values[part.name]))
        elif all(values.get(name) is not None for name in part.fields):
            _write(part.parts, values, out)


def render(vllm_message: str, **values: object) -> str:
    """vLLM's text, then kvobs's message with ``values`` (one per field of :data:`MESSAGE`; None leaves
    out a :class:`Maybe`'s parts)."""
    out = [vllm_message]
    _write(MESSAGE, values, out)
    return "".join(out)


def pattern(parts: Sequence[Part]) -> str:
    """The regular expression ``parts`` are read with: literal text escaped, a field as its named group."""
    out = []
    for part in parts:
        if isinstance(part, str):
            out.append(re.escape(part))
        elif isinstance(part, Field):
            out.append(f"(?P<{part.name}>{part.pattern})")
        else:
            out.append(f"(?:{pattern(part.parts)})?")
    return "".join(out)


SUFFIX_RE = re.compile(pattern(SUFFIX))
"""Matched where vLLM's text ends: ``group`` and ``req_id``."""
CAUSE_RE = re.compile(pattern(CAUSE) + END)
"""Searched for after :data:`SUFFIX_RE`'s match: ``cause``, ``evidence``, ``causes``."""
MESSAGE_RE = re.compile(pattern(MESSAGE) + END)
"""The whole of kvobs's message, every field."""


def read(text: str, pos: int = 0) -> dict[str, str | None] | None:
    """The written text of each field of the message that starts at ``text[pos]`` (where vLLM's ends);
    None for a :class:`Maybe`'s field left out, and None in all when it is not kvobs's message whole."""
    match = MESSAGE_RE.match(text, pos)
    return None if match is None else match.groupdict()
