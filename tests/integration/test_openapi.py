"""The sidecar's OpenAPI document (GET /api/v1/openapi.json, kvobs/sidecar/openapi.json) against the running
server: schemathesis generates requests for every operation the document describes (a bounded number of
examples each) and checks each answer: no server error, a documented status code, the documented content
type and a body that fits the documented schema.

Real parts: a ``kvobs serve`` process over a directory that vLLM's real CPU manager under ``kvobs.observe()``
filled (a journal, a failed load's failure report and its replay bundle: tests/fuzz/real_data.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (
    FailureGroup,
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.result import Ok

from kvobs.bundles import BUNDLE_DIR, BUNDLE_SUFFIX
from kvobs.codes import REPORT_CAUSES
from kvobs.sidecar.query import MAX_FAILURES
from kvobs.sidecar.server import OPENAPI_PATH
from kvobs.wire.format import ENGINE_LABEL, FAILURES_DIR
from tests.fuzz.real_data import write
from tests.support.services import Sidecar, http_get

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
EXAMPLES = 15
"""Examples per operation (schemathesis's generated ones, besides the document's): the whole run well under a
minute on two cores."""


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    directory = tmp_path_factory.mktemp("kvobs")
    write(directory)
    running = Sidecar(directory).start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def api(sidecar: Sidecar) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{sidecar.url}{OPENAPI_PATH}")


def test_the_document_is_served_and_names_every_endpoint_the_server_lists(sidecar: Sidecar) -> None:
    status, content_type, body = http_get(f"{sidecar.url}{OPENAPI_PATH}")
    assert status == 200 and content_type == "application/json"
    document = json.loads(body)
    assert document["openapi"].startswith("3.")
    _, _, index = http_get(f"{sidecar.url}/")
    listed = {e.removeprefix("POST ").replace("<id>", "{id}") for e in json.loads(index)["endpoints"]}
    assert listed | {"/"} == set(document["paths"])
    # The rules the document repeats are the code's (kvobs.sidecar.query, kvobs.wire.format, kvobs.codes).
    params = {p["name"]: p["schema"] for p in document["paths"]["/api/v1/failures"]["get"]["parameters"]}
    assert params["cause"]["items"]["enum"] == list(REPORT_CAUSES)
    assert (params["limit"]["minimum"], params["limit"]["maximum"]) == (1, MAX_FAILURES)
    assert params["engine"]["items"]["pattern"] == f"^{ENGINE_LABEL.pattern}$"
    assert re.fullmatch(params["before"]["pattern"].strip("^$"), "001796583651389-dp0-1-2")
    # The data the generated requests meet is real: a report and a bundle whose ids the API serves.
    report_id = next((sidecar.dir / FAILURES_DIR).glob("*.json")).stem
    bundle_id = next((sidecar.dir / BUNDLE_DIR).glob("*" + BUNDLE_SUFFIX)).name.removesuffix(BUNDLE_SUFFIX)
    assert http_get(f"{sidecar.url}/api/v1/failures/{report_id}")[0] == 200
    assert http_get(f"{sidecar.url}/api/v1/replays/{bundle_id}")[0] == 200


def _check(operation: Any, mode: GenerationMode, calls: list[str]) -> None:
    """Up to ``EXAMPLES`` requests of ``operation``, each answer through ``CHECKS``; the first failure raised."""

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
              phases=[Phase.explicit, Phase.generate], database=None)
    def answers_as_documented(case: schemathesis.Case) -> None:
        calls.append(operation.label)
        case.call_and_validate(checks=CHECKS, timeout=10)

    answers_as_documented()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"])
def test_every_operation_answers_as_documented(api: schemathesis.BaseSchema, mode: GenerationMode) -> None:
    """Valid requests (by the document) and invalid ones (a parameter that breaks its schema): either way an
    answer the document describes. Each operation by hand, not schemathesis.pytest.from_fixture: that reads a
    private attribute of pytest's node (``_nodeid``) pytest 9 no longer has. The failures are reported together."""
    failed: list[str] = []
    calls: list[str] = []
    results = list(api.get_all_operations())
    assert all(isinstance(result, Ok) for result in results), results  # the document reads whole
    operations = [result.ok() for result in results if isinstance(result, Ok)]
    assert len(operations) >= 15, [op.label for op in operations]
    if mode is GenerationMode.NEGATIVE:  # a path's id may be any text: only a query can be invalid
        operations = [op for op in operations
                      if any(p.get("in") == "query" for p in op.definition.raw.get("parameters", []))]
    for operation in operations:
        try:
            _check(operation, mode, calls)
        except Unsatisfiable:  # /metrics's name[] takes any text: no invalid request to make
            assert mode is GenerationMode.NEGATIVE and operation.path == "/metrics", operation.label
        except (Exception, FailureGroup) as exc:  # each check's failure, with the request that reproduces it
            failed.append(f"{operation.label}: {str(exc)[:3000]}")
    assert not failed, "\n\n".join(failed)
    checked = {op.label for op in operations if op.path != "/metrics" or mode is GenerationMode.POSITIVE}
    assert checked <= set(calls) and len(calls) >= 3 * len(checked), (checked - set(calls), len(calls))
