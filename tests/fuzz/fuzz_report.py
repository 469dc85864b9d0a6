"""Target ``report``: a failure report file through ``kvobs.wire.decode.read_report``, then as the sidecar
uses one: folded into its state, served by /api/v1/failures (``served_report``), the JSON written.

Contract: ``read_report`` raises only ValueError (too large, not JSON, not a kvobs report) for a regular
file; a report it returns folds, serves and serialises without an exception."""

from __future__ import annotations

import json

from kvobs.sidecar.failures import FailureQuery, failure_page, served_report
from kvobs.sidecar.state import SidecarState
from kvobs.wire.decode import read_report
from kvobs.wire.format import FAILURES_DIR
from tests.fuzz._scratch import scratch

_ID = "001796583651390-0-5514-1"
_FAILURES = scratch("report") / FAILURES_DIR
_FAILURES.mkdir()
_PATH = _FAILURES / f"{_ID}.json"
_QUERY = FailureQuery.parse("engine=0&limit=5")


def TestOneInput(data: bytes) -> None:
    _PATH.write_bytes(data)
    try:
        report = read_report(_PATH)
    except ValueError:
        return
    SidecarState().apply_report(report)
    json.dumps(served_report(report, _ID))
    page, _ = failure_page(_FAILURES, _QUERY)
    json.dumps(page)
