"""A defect injected into a real engine's offload manager, for ``kvobs demo --serve`` and tests/engine.

Never configure it in production: it exists to make a real ``vllm serve`` die the way vLLM #50014
kills engines, or with an exception out of a lookup (``LookupRaisesSpec``), on demand (loaded by vLLM as
kvobs's inner spec, ``demo.defects``).

``LookupEvictsSpec`` is kvobs's CPU copy spec (vLLM's ``CPUOffloadingSpec``, demo/cpu_worker.py)
whose manager, once armed, does what a tiering promotion does inside ``lookup()`` in vLLM #50014: in
the lookup after the one that reported a chunk as a HIT, it stores new chunks, and the capacity
evictions of those stores remove the chunk the request was just promised. The connector then asks
``prepare_load()`` for it and vLLM's own assertion kills EngineCore. Armed by creating the file named by
``KVOBS_DEFECT_TRIGGER`` (so the engine serves normally until the demo or test wants it to die);
fires once.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingManager,
    OffloadKey,
    get_offload_group_idx,
    make_offload_key,
)

from demo.cpu_worker import CPUCopyOffloadingSpec
from demo.engine import DEFECT_FIRED_SUFFIX, DEFECT_TRIGGER_ENV
from kvobs.vllm.spec import ObservedOffloadingSpec

TRIGGER_ENV, FIRED_SUFFIX = DEFECT_TRIGGER_ENV, DEFECT_FIRED_SUFFIX


def _arm_eviction_inside_lookup(manager: OffloadingManager, trigger: Path) -> None:
    lookup = manager.lookup
    serial = [0]
    reported: list[OffloadKey] = []  # the armed request's first HIT

    def evict_until_gone(key: OffloadKey, req_context: Any) -> None:
        group = get_offload_group_idx(key)
        for _ in range(4096):  # bounded: stores of new chunks until the reported one is evicted
            serial[0] += 1
            batch = [make_offload_key(serial[0].to_bytes(len(key) - 4, "big"), group)]
            if manager.prepare_store(batch, req_context) is not None:
                manager.complete_store(batch, req_context)
            if lookup(key, req_context) is not LookupResult.HIT:
                return

    def lookup_that_evicts(key: OffloadKey, req_context: Any) -> LookupResult:
        if reported:  # the lookup after the HIT: a "promotion" evicts the chunk the last one reported
            evict_until_gone(reported.pop(), req_context)
        result = lookup(key, req_context)
        if result is LookupResult.HIT and trigger.exists():
            trigger.rename(trigger.with_name(trigger.name + FIRED_SUFFIX))  # once
            reported.append(key)
        return result

    manager.lookup = lookup_that_evicts  # type: ignore[method-assign]


def _arm_eviction_before_load(manager: OffloadingManager, trigger: Path) -> None:
    """Once armed, the next load first evicts its first chunk (stores of new chunks until it is gone):
    an eviction between a request's lookup and its load, as #50014's promotions do, but after the
    whole lookup pass, so that it also reaches hybrid models (the connector looks their groups up
    again until the hit converges, which would see an eviction made inside lookup)."""
    prepare_load = manager.prepare_load
    serial = [1 << 40]

    def load_after_an_eviction(keys: Any, req_context: Any) -> Any:
        keys = list(keys)
        if keys and trigger.exists():
            trigger.rename(trigger.with_name(trigger.name + FIRED_SUFFIX))  # once
            victim = keys[0]
            group = get_offload_group_idx(victim)
            for _ in range(4096):  # bounded: stores of new chunks until the first chunk is evicted
                if manager.lookup(victim, req_context) is not LookupResult.HIT:
                    break
                serial[0] += 1
                batch = [make_offload_key(serial[0].to_bytes(len(victim) - 4, "big"), group)]
                if manager.prepare_store(batch, req_context) is not None:
                    manager.complete_store(batch, req_context)
        return prepare_load(keys, req_context)

    manager.prepare_load = load_after_an_eviction  # type: ignore[method-assign]


class ArmedDefect:
    """An offloading spec whose manager gets the defect ``arm`` (once per manager) when ``KVOBS_DEFECT_TRIGGER``
    names a trigger file; put before the spec class it arms (``class X(ArmedDefect, SomeSpec)``)."""

    arm: Callable[[OffloadingManager, Path], None]

    def get_manager(self) -> OffloadingManager:
        manager: OffloadingManager = super().get_manager()  # type: ignore[misc]
        trigger = os.environ.get(TRIGGER_ENV)
        if trigger and not getattr(manager, "_kvobs_demo_defect", False):
            type(self).arm(manager, Path(trigger))
            manager._kvobs_demo_defect = True  # type: ignore[attr-defined]
        return manager


class LoadEvictsSpec(ArmedDefect, CPUCopyOffloadingSpec):
    """kvobs's CPU copy spec whose manager, once armed, evicts the first chunk of the next load just
    before it (:func:`_arm_eviction_before_load`); fires once."""

    arm = staticmethod(_arm_eviction_before_load)


class CallerEvictsSpec(ArmedDefect, ObservedOffloadingSpec):
    """kvobs's own spec (around the inner spec its ``kvobs`` options name) whose *observed* manager, once armed,
    evicts the first chunk of the next load just before it (:func:`_arm_eviction_before_load`), through the
    observed manager's own calls: the code that breaks the promise is a caller, as a connector or scheduler
    bug would be, so kvobs's flight recorder sees every call and ``kvobs replay`` reproduces the engine's
    death from its bundle (tests/engine/test_replay_engine.py). Fires once."""

    arm = staticmethod(_arm_eviction_before_load)


class LookupEvictsSpec(ArmedDefect, CPUCopyOffloadingSpec):
    """kvobs's CPU copy spec whose manager, once armed, evicts in the lookup after a HIT the chunk it
    reported (:func:`_arm_eviction_inside_lookup`); fires once."""

    arm = staticmethod(_arm_eviction_inside_lookup)


def _arm_raise_in_lookup(manager: OffloadingManager, trigger: Path) -> None:
    """Once armed, the next lookup raises ``OSError(EIO)``, as a tier whose storage failed would: an exception
    out of the connector's ``get_num_new_matched_tokens`` (kvobs's boundary reports it; survive mode answers
    no hit instead). Fires once."""
    lookup = manager.lookup

    def lookup_that_raises(key: OffloadKey, req_context: Any) -> LookupResult:
        if trigger.exists():
            trigger.rename(trigger.with_name(trigger.name + FIRED_SUFFIX))  # once
            raise OSError(errno.EIO, "injected by demo.defects: the offload tier could not be read")
        return lookup(key, req_context)

    manager.lookup = lookup_that_raises  # type: ignore[method-assign]


class LookupRaisesSpec(ArmedDefect, CPUCopyOffloadingSpec):
    """kvobs's CPU copy spec whose manager, once armed, raises in the next lookup
    (:func:`_arm_raise_in_lookup`); fires once."""

    arm = staticmethod(_arm_raise_in_lookup)
