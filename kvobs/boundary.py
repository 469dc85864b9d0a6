"""An exception that left vLLM's offloading code through kvobs's connector, as one value every sink reads.

Why a value of its own rather than a :class:`~kvobs.diagnosis.Diagnosis`: there are no missing keys to
classify, only where it happened (:class:`~kvobs.sites.Site`), the requests it involved and what kvobs
saw of them (:mod:`kvobs.lifecycle`). Pure (no vLLM): built by kvobs/vllm/boundary.py, read by the
journal's report (``kvobs.wire.encode.exception_report``), the span (``kvobs.tracing``) and the log line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvobs.codes import EXCEPTION_CAUSES
from kvobs.sites import Site

LOG_PREFIX = "kv offload exception"
"""The start of the engine's log line for one (``kvobs explain`` and log searches key on it)."""
LABEL_ROOM = 64 - max(map(len, EXCEPTION_CAUSES)) - 1
"""Characters of a site label: ``kvobs_offload_exceptions``'s totals key, cause and site, is a short label
(``kvobs.wire.format.MAX_SHORT_LABEL``, 64)."""
THROUGH_CONNECTOR = "through the connector's "
THROUGH_MANAGER = "through the offload manager's "
"""How the line names the call it left through (``kvobs explain`` reads both: kvobs/explain_tracebacks.py)."""
MAX_MESSAGE = 2_000
"""Characters of the exception's own text kept."""
SURVIVED = "computed instead (kvobs survive)"
"""The end of the log line and message of an exception survive mode answered for (``OffloadException.recomputed``)."""


def cause_of(exc: BaseException) -> str:
    """``vllm_assertion`` for an AssertionError (vLLM's asserts), else ``vllm_exception``."""
    return EXCEPTION_CAUSES[0] if isinstance(exc, AssertionError) else EXCEPTION_CAUSES[1]


@dataclass(frozen=True, slots=True)
class OffloadException:
    """Everything a report, a span and a log line say of one exception at the boundary."""

    side: str
    """``scheduler`` or ``worker``: the connector's side it left through; ``manager``: it left vLLM's manager
    through kvobs's taps, with no kvobs connector above (vLLM's own ``OffloadingConnector``, ``kvobs.observe()``)."""
    method: str
    """The connector's method it left (``build_connector_meta``, ...)."""
    cause: str
    """One of ``kvobs.codes.EXCEPTION_CAUSES``."""
    exception_type: str
    vllm_message: str
    """``str(exc)``, as vLLM wrote it (cut to ``MAX_MESSAGE``)."""
    site: Site | None
    """The innermost frame inside vLLM's package (None: none was, e.g. raised by the caller's own code)."""
    raised_at: Site | None
    """The innermost frame of all, where that is not ``site`` (a plugin's, kvobs's, an injection's)."""
    req_ids: Sequence[str]
    """The requests the call involved (its request argument, the step's scheduled and finished ones)."""
    requests: Sequence[Mapping[str, Any]]
    """Each involved request's lifecycle as kvobs's connector saw it (kvobs.lifecycle.Lifecycle.of)."""
    events: Sequence[Mapping[str, Any]]
    """The connector's most recent calls, oldest first."""
    releases: Mapping[str, str]
    """``vllm`` and ``kvobs`` versions."""
    not_recorded: Sequence[str] = ()
    """What the lifecycle does not hold (kvobs.lifecycle.NOT_RECORDED)."""
    time: float = 0.0
    recomputed: bool = False
    """Survive mode answered vLLM in its place (a lookup that raised reports no hit, so vLLM computes the
    prefix itself): the exception never reached vLLM and the engine goes on."""
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """The ``site`` label of ``kvobs_offload_exceptions``: vLLM's ``file:function``, its leading directories
        dropped to fit the counter's key (cause, space, site: a short label of the wire); "" when no frame was
        inside vLLM's package."""
        return self.site.label(LABEL_ROOM) if self.site is not None else ""

    @property
    def message(self) -> str:
        """One line (newlines of vLLM's text written ``\\n``): the site, its expression, the call, the
        exception, the requests."""
        site = self.site
        where = (f"{site.file}:{site.line} in {site.function}" if site is not None
                 else "outside vLLM's package")
        said = ""
        if site is not None and site.expression:
            said = f" ({'assert ' if site.statement == 'assert' else ''}{site.expression})"
        raised = ""
        if self.raised_at is not None:
            raised = f"; raised at {self.raised_at.file}:{self.raised_at.line} in {self.raised_at.function}"
        through = (f"{THROUGH_MANAGER}{self.method}" if self.side == "manager"
                   else f"{THROUGH_CONNECTOR}{self.side}-side {self.method}")
        text = self.vllm_message[:300].replace(chr(10), chr(92) + "n")
        return (f"{LOG_PREFIX} at {where}{said}{raised}; {through}; {self.exception_type}: {text}; "
                f"requests: {list(self.req_ids)[:16]!r}; cause: {self.cause}; vLLM {self.releases.get('vllm', '?')}"
                + (f"; {SURVIVED}" if self.recomputed else ""))
