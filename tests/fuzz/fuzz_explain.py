"""Target ``explain``: bytes as a log file through ``kvobs explain``'s parser (``kvobs.explain.scan_log``,
kvobs.logtext: any encoding, compression, escapes, JSON wrapping; the offload exceptions' tracebacks and kvobs's
lines, kvobs.explain_tracebacks), then rendered as text and as JSON.

Contract: ``scan_log`` raises only ``kvobs.explain.ExplainError`` (a compression it cannot read); what it
finds renders (``render``, ``as_json``, ``explain_tracebacks.as_json``) without an exception."""

from __future__ import annotations

import io
import json

from kvobs import explain_tracebacks
from kvobs.explain import ExplainError, as_json, render, scan_log


def TestOneInput(data: bytes) -> None:
    try:
        scan = scan_log(io.BufferedReader(io.BytesIO(data)))  # as open(path, "rb") gives it
    except ExplainError:
        return
    render(scan.assertions, scan.not_shown, False, "fuzz.log", scan.damage, scan.exceptions, scan.exceptions_not_shown)
    json.dumps([as_json(scan.assertions), explain_tracebacks.as_json(scan.exceptions)])
