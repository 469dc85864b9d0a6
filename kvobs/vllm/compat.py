"""Everything kvobs knows about vLLM's offload code: its protocol, its private attributes.

The only module that reads a private vLLM attribute or knows a release difference;
everything else in ``kvobs.vllm`` asks it. The protocol relied on (vLLM 0.33.0):

* every chunk that leaves the CPU tier leaves through the cache policy of the CPU-resident
  manager (``CPUOffloadingManager._policy``): ``evict(n, protected) -> [(key, chunk)] | None``
  (capacity, inside ``prepare_store``; also reached from tiering promotions inside
  ``lookup()``, ``on_schedule_end()`` and the tier-poll thread), ``remove(key)`` (a failed
  store, from ``complete_store(success=False)``) and ``clear()`` (``reset_cache()``);
* ``policy.insert(key, chunk, req_context)`` adds a stored chunk; ``policy.get(key)`` finds it;
  a chunk has ``chunk_id`` (its slot) and ``is_ready``;
* the built-in LRU policy keeps its chunks in ``chunks``, ARC in ``t1`` and ``t2``;
* a tiering manager's CPU tier is ``TieringOffloadingManager.primary_tier``.

:func:`check` verifies all of it on a live manager before kvobs touches anything, and
raises :class:`ProtocolMismatch` naming what is missing: the plugin then steps aside
(``kvobs.vllm.spec``) and ``kvobs.observe()`` raises it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import metadata
from typing import Any

from vllm.v1.kv_offload.base import LookupResult, OffloadingManager, OffloadKey
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

from kvobs.recording import ClearTap, EvictTap, InsertTap, PolicyTap, Recorder, RemoveTap


def _version() -> str:
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return "unknown"


VLLM_VERSION = _version()
HIT = LookupResult.HIT
HIT_PENDING = LookupResult.HIT_PENDING

POLICY_TABLES = ("chunks", "t1", "t2")
"""Where the built-in policies keep resident chunks (LRU: ``chunks``; ARC: ``t1``, ``t2``)."""
POLICY_METHODS = ("evict", "remove", "clear", "insert", "get")


class ProtocolMismatch(Exception):
    """The vLLM code in front of kvobs is not what kvobs knows how to observe."""


def cpu_tier_of(manager: OffloadingManager) -> CPUOffloadingManager | None:
    """The CPU-resident manager whose policy sees every removal, or None for a manager kvobs cannot hook."""
    if isinstance(manager, TieringOffloadingManager):
        tier = getattr(manager, "primary_tier", None)
        return tier if isinstance(tier, CPUOffloadingManager) else None
    if isinstance(manager, CPUOffloadingManager):
        return manager
    return None


def lookup_can_remove(manager: OffloadingManager) -> bool:
    """Whether ``lookup()`` can remove chunks: a tiering manager promotes from inside it."""
    return not isinstance(manager, CPUOffloadingManager)


def policy_of(cpu: CPUOffloadingManager) -> Any:
    return cpu._policy


def num_chunks(cpu: CPUOffloadingManager) -> int:
    """Slots of the CPU tier (residency stamps are kept per slot)."""
    return int(cpu._num_chunks)


def is_hooked(manager: OffloadingManager) -> bool:
    """Whether kvobs already observes this manager's CPU tier (through another wrapper)."""
    cpu = cpu_tier_of(manager)
    policy = getattr(cpu, "_policy", None)
    # getattr, never policy.__dict__: reading an instance's __dict__ makes CPython 3.11 give it a real
    # dict, and every attribute access of vLLM's policy code then runs unspecialised (5% of its CPU).
    return policy is not None and any(isinstance(getattr(policy, name, None), PolicyTap) for name in POLICY_METHODS)


def check(manager: OffloadingManager) -> None:
    """Raise ProtocolMismatch unless kvobs knows everything it reads of ``manager``."""
    if isinstance(manager, TieringOffloadingManager) and cpu_tier_of(manager) is None:
        raise ProtocolMismatch("TieringOffloadingManager without a CPU primary_tier")
    cpu = cpu_tier_of(manager)
    if cpu is None:
        return  # an unknown manager: its calls are observed, its removals are not (README)
    missing = [name for name in ("_policy", "_num_chunks") if not hasattr(cpu, name)]
    if missing:
        raise ProtocolMismatch(f"{type(cpu).__name__} has no {', '.join(missing)}")
    policy = cpu._policy
    missing = [name for name in POLICY_METHODS if not callable(getattr(policy, name, None))]
    if missing:
        raise ProtocolMismatch(f"cache policy {type(policy).__name__} has no {', '.join(missing)}()")
    if not any(isinstance(getattr(policy, table, None), Mapping) for table in POLICY_TABLES):
        raise ProtocolMismatch(
            f"cache policy {type(policy).__name__} keeps its chunks in none of {', '.join(POLICY_TABLES)}"
        )


def resident_chunks(policy: Any) -> list[tuple[bytes, Any]]:
    """(key, chunk) of every resident chunk; ProtocolMismatch when the policy keeps them elsewhere."""
    found: list[tuple[bytes, Any]] = []
    known = False
    for name in POLICY_TABLES:
        table = getattr(policy, name, None)
        if isinstance(table, Mapping):
            known = True
            found.extend(table.items())
    if not known:
        raise ProtocolMismatch(f"cannot list the chunks of cache policy {type(policy).__name__} at a reset")
    return found


def hook_policy(cpu: CPUOffloadingManager, recorder: Recorder, *, stamp_inserts: bool) -> None:
    """Tap the CPU tier's cache policy: every removal (any thread), and every insert when
    ``stamp_inserts`` (residency, for the journal; it costs a call per stored chunk).

    The taps are instance attributes calling the original bound methods, so the policy
    stays the same object of the same class with the same state.
    """
    policy = cpu._policy
    taps: list[tuple[str, Callable[..., Any]]] = [
        ("evict", EvictTap(recorder, policy.evict)),
        ("remove", RemoveTap(recorder, policy.remove, lambda key: policy.get(OffloadKey(key)))),
        ("clear", ClearTap(recorder, policy.clear, lambda: resident_chunks(policy))),
    ]
    if stamp_inserts:
        taps.append(("insert", InsertTap(recorder, policy.insert)))
    for name, tap in taps:
        setattr(policy, name, tap)


def chunk_state(cpu: CPUOffloadingManager, key: bytes) -> str | None:
    """``None`` when the chunk can be read, else ``"missing"`` or ``"not_ready"``."""
    chunk = cpu._policy.get(OffloadKey(key))
    if chunk is None:
        return "missing"
    return None if chunk.is_ready else "not_ready"


def key_position(req_context: Any, key: bytes) -> int | None:
    """The chunk's end token, as the connector set it on the request context."""
    return req_context.get_offload_key_position(key)


def request_context(connector_scheduler: Any, request_id: str) -> Any | None:
    """The ReqContext the connector scheduler keeps for a request (to carry its trace context)."""
    status = connector_scheduler._req_status.get(request_id)
    return None if status is None else status.req_context
