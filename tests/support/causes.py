"""A real observed manager driven to a failed load, and kvobs's message read back: the steps the cause
tests take (tests/integration/test_causes.py, test_survive.py, test_verdict_overflow.py)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from vllm.v1.kv_offload.base import OffloadingManager, ReqContext, ScheduleEndContext

import kvobs
from kvobs.vllm import ObservedOffloadingManager
from tests.support.vllm_env import create_manager, set_position

END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
MESSAGE = re.compile(
    r"^Chunk b'.*' (?:not found in cache|is not ready for reading) "
    r"\(group=(?P<group>\d+), req_id='(?P<req>[^']*)'\)\. (?P<missing>\d+) of (?P<total>\d+) keys in this load "
    r"are missing\. \(end_token, seconds since eviction\) per missing key: (?P<listed>\[.*\]); "
    r"load end_token range: (?P<range>\S+); eviction history: (?P<hist>\d+) keys over (?P<window>[\d.]+)s\. "
    r"cause: (?P<cause>\w+) \((?P<evidence>.*)\)",
    re.S,
)


def observed(managers: list, extra: dict[str, Any], **options: Any) -> ObservedOffloadingManager:
    manager = kvobs.observe(create_manager(extra), **options)
    managers.append(manager)
    return manager


def ctx(manager: OffloadingManager, req_id: str, positions: dict[bytes, int] | None = None) -> ReqContext:
    context = ReqContext(req_id)
    for k, position in (positions or {}).items():
        set_position(context, k, position)
    manager.on_new_request(context)
    return context


def store(manager: OffloadingManager, keys: list[bytes], context: ReqContext, complete: bool = True) -> None:
    out = manager.prepare_store(keys, context)
    assert out is not None
    if complete:
        manager.complete_store(keys, context)


def failed_load(manager: ObservedOffloadingManager, keys: list[bytes], context: ReqContext) -> re.Match[str]:
    with pytest.raises(AssertionError) as info:
        manager.prepare_load(keys, context)
    match = MESSAGE.match(str(info.value))
    assert match is not None, str(info.value)
    return match
