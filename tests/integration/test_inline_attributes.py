"""kvobs never gives vLLM's live objects a real ``__dict__``.

On CPython 3.11 an object keeps its attributes inline until something reads its ``__dict__``; from then on
every attribute access of vLLM's code on it runs unspecialised. Reading the CPU manager's ``__dict__`` once
(``hook_policy`` did, for tiering's ``prepare_write``) cost the bare manager 14% of its CPU on
benchmarks/overhead.py's trace (docs/performance.md, "Inline attributes"). Here vLLM's real managers are
observed with every option that reads them (the journal, the failure reports, the flight recorder and its
bundle where the recorder runs), driven through stores, evictions, a failed store, a failed load and a
reset; the wrapper's inner manager, its CPU tier and that tier's cache policy must still keep their
attributes inline.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest

from kvobs.bundles import BUNDLE_DIR, BUNDLE_SUFFIX
from kvobs.vllm import compat
from tests.support.causes import ctx, observed, store
from tests.support.vllm_env import cpu_extra, create_manager, key, tiering_extra

EXTRAS = {"cpu": cpu_extra, "tiering": tiering_extra}


def _vllm_objects(inner: Any) -> dict[str, Any]:
    cpu = compat.cpu_tier_of(inner)
    return {"manager": inner, "cpu tier": cpu, "policy": cpu._policy}


@pytest.mark.parametrize("kind", sorted(EXTRAS))
def test_observing_and_failing_leave_vllms_attributes_inline(managers: list, tmp_path: Path, kind: str) -> None:
    m = observed(managers, EXTRAS[kind](4), dir=str(tmp_path))
    objects = _vllm_objects(m._kvobs_inner)
    a, b = ctx(m, "req-a"), ctx(m, "req-b")
    store(m, [key(1), key(2), key(3), key(4)], a)
    m.lookup(key(1), a)
    if m.prepare_store([key(11), key(12), key(13)], b) is not None:  # evicts what the lookup promised
        m.complete_store([key(11), key(12), key(13)], b)
    if m.prepare_store([key(21)], b) is not None:  # (a tiering manager of some releases refuses both)
        m.complete_store([key(21)], b, False)  # a failed store: the policy's remove
    with contextlib.suppress(AssertionError):  # raised where the store above evicted it (the CPU manager's: always)
        m.prepare_load([key(1)], a)
    m.on_request_finished(a)
    m.reset_cache()
    m.observer.drain()
    if kind == "cpu":  # the failure's bundle: the recorder snapshots only vLLM's CPU manager (README)
        assert next((tmp_path / BUNDLE_DIR).glob(f"*{BUNDLE_SUFFIX}"), None) is not None
    made_real = [name for name, obj in objects.items() if compat.real_dict(obj) is not None]
    assert made_real == [], f"kvobs gave vLLM's {made_real} a real __dict__"


def test_the_check_sees_a_dict_read() -> None:
    """The check above can fail: one read of ``__dict__`` is enough, and ``real_dict`` sees it."""
    manager = create_manager(cpu_extra(4))
    try:
        cpu = compat.cpu_tier_of(manager)
        assert compat.real_dict(cpu) is None and compat.real_dict(cpu._policy) is None
        assert "_policy" in cpu.__dict__
        assert compat.real_dict(cpu) is not None and compat.real_dict(cpu._policy) is None
    finally:
        manager.shutdown()
