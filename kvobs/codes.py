"""The codes every part of kvobs shares: reasons, paths, causes, stages, flag packing, the recorder's defaults.

One definition each, imported by the engine side (recording, history, diagnosis,
journal), the sidecar and ``kvobs explain`` alike. Pure data: no numpy, no vLLM.
The label values here are a contract (DESIGN.md, "Metrics"): dashboards and
alerts rely on them.
"""

from __future__ import annotations

from collections.abc import Callable

REASONS: tuple[str, ...] = ("capacity", "store_failed", "reset", "deferred_release")
"""Why chunks left the CPU tier (the ``reason`` label). ``deferred_release``: vLLM 0.34's tiering
failed a promotion's write and took its chunks out of the cache with their slots held until the
tier lets go (``CPUPrimaryTierOffloadingManager.defer_write_release``)."""
CAPACITY, STORE_FAILED, RESET, DEFERRED_RELEASE = 0, 1, 2, 3
assert REASONS[CAPACITY] == "capacity" and REASONS[STORE_FAILED] == "store_failed" and REASONS[RESET] == "reset"
assert REASONS[DEFERRED_RELEASE] == "deferred_release"

PATHS: tuple[str, ...] = (
    "store",
    "lookup",
    "schedule_end",
    "complete_store",
    "reset",
    "poll_thread",
    "unobserved",
)
"""Which manager entry point was running when a removal happened."""
PATH_CODE: dict[str, int] = {name: code for code, name in enumerate(PATHS)}
POLL_THREAD_NAME = "vllm_offload_tier_poll"
"""vLLM's tier-poll thread: removals there have no tapped call above them (path ``poll_thread``)."""
REASON_CODE: dict[str, int] = {name: code for code, name in enumerate(REASONS)}

CAUSES: tuple[str, ...] = (
    "evicted_after_lookup",
    "reset_after_lookup",
    "store_failed_after_lookup",
    "coverage_mismatch",
    "store_in_flight",
    "unknown",
)
"""Every cause a missing key can have (the ``cause`` label; DESIGN.md, "Causes")."""

CAUSE_OF_REASON: dict[str, str] = {
    "capacity": "evicted_after_lookup",
    "reset": "reset_after_lookup",
    "store_failed": "store_failed_after_lookup",
    "deferred_release": "store_failed_after_lookup",  # a failed write too: the promotion's
}
"""The cause of a missing key whose promise a removal of this reason broke."""
assert set(CAUSE_OF_REASON) == set(REASONS) and set(CAUSE_OF_REASON.values()) <= set(CAUSES)

EXCEPTION_CAUSES: tuple[str, ...] = ("vllm_assertion", "vllm_exception")
"""The cause of an exception that left vLLM's offloading code through kvobs's connector (kvobs/vllm/boundary.py):
an AssertionError, or any other exception. A taxonomy of its own, not :data:`CAUSES` (those are the causes of a
missing key, and label ``kvobs_load_failures``); the ``cause`` label of ``kvobs_offload_exceptions`` and the
``cause`` of such a failure report. A failed ``prepare_load`` kvobs explained keeps its :data:`CAUSES` cause."""
assert not set(EXCEPTION_CAUSES) & set(CAUSES)
REPORT_CAUSES: tuple[str, ...] = CAUSES + EXCEPTION_CAUSES
"""Every cause a failure report names: a failed load's, or an exception's at the boundary (the sidecar's
``/api/v1/failures?cause=`` filters by these)."""

STAGES: tuple[str, ...] = (
    "record.removal",
    "record.lookup",
    "record.load",
    "record.finish",
    "record.schedule_end",
    "diagnosis",
    "verdicts",
    "journal",
    "report",
    "tracing",
    "sink",
    "shutdown",
    "hook",
    "survive",
    "record.store",
    "flight",
    "boundary",
)
"""Where kvobs can hit a fault of its own (the ``stage`` label of ``kvobs_internal_errors_total``)."""

CPU_TIER = "cpu"
"""The CPU tier's ``tier`` label value: the one tier kvobs's tier counters count (the recorder's fold)."""
TIERS: tuple[str, ...] = (CPU_TIER,)
"""The offload tiers kvobs counts writes, reads and removals of (the ``tier`` label): the CPU tier, where
vLLM exports no per-chunk account. A tiering manager's secondary tiers (file system, remote) are vLLM's own
figures (``vllm:kv_offload_tiering_write_bytes`` / ``read_bytes`` by tier; the file-system tier evicts
nothing), which kvobs does not count a second time (README, "Is the tier doing anything")."""

READ_BACK_SHARE = ("kvobs_read_once_chunks_total", "kvobs_written_chunks_total")
"""The read-back share of a tier, defined here once: chunks read at least once since written over chunks
written into the tier by any path (stores from the GPU and promotions from a lower tier). Never above 1,
unlike loads over stores (a chunk re-read counts once; a promoted chunk is written too). The README, the
demo's summary (:func:`read_back_share`), the dashboard and the alert (:func:`read_back_share_promql`) all
take it from here."""


def read_back_share(read_once: int, written: int) -> float | None:
    """:data:`READ_BACK_SHARE` of counts (None where nothing was written)."""
    return read_once / written if written > 0 else None


def read_back_share_promql(increase: Callable[[str], str], by: str) -> str:
    """:data:`READ_BACK_SHARE` in PromQL: ``increase(name)`` gives the expression of one counter's increase
    (a ``rate``, an ``increase``, a dashboard's count in range), summed ``by`` the labels given; no data where
    nothing was written."""
    read_once, written = READ_BACK_SHARE
    return f"sum by ({by}) ({increase(read_once)}) / (sum by ({by}) ({increase(written)}) > 0)"

DROP_STAGES: tuple[str, ...] = ("journal", "verdicts", "ingest")
"""Where kvobs drops records to stay bounded (the ``stage`` label of ``kvobs_dropped_records_total``); ``ingest``:
strings of an engine's lines and reports the sidecar read as invalid text and replaced (kvobs.wire.format.load_json)."""

# -- a removal batch's flags: reason in the low bits, path above ---------------------

REASON_BITS = 2
REASON_MASK = (1 << REASON_BITS) - 1
assert len(REASONS) <= 1 << REASON_BITS, "reasons outgrew their bits"
assert (len(PATHS) - 1) << REASON_BITS | REASON_MASK < 256, "flags must fit one byte"


def pack_flags(reason: int, path: int) -> int:
    """One byte per removal batch: ``reason | path << REASON_BITS``."""
    return reason | (path << REASON_BITS)


def unpack_flags(flags: int) -> tuple[int, int]:
    """(reason code, path code) of packed flags."""
    return flags & REASON_MASK, flags >> REASON_BITS


# -- the recorder's defaults (the options' are kvobs.options.Options's fields) ------------

DRAIN_KEYS = 16_384
"""Queued removal keys that make the recorder ask for a drain."""
DRAIN_BATCHES = 2_048
"""Queued removal batches that make the recorder ask for a drain."""
RECENT_KEYS = 4_096
"""Removed keys the hot path remembers (per generation; kvobs.hot_promises.RecentRemovals). A load
redeems promises its lookup made in the same scheduler step, a few hundred removals earlier at
most; an older promise is settled from the eviction history (Observer.near_missed), so this only
bounds the fast path (it was 32,768: 6.7 MiB at a 1M-key history, issue 22)."""

CAPTURE_WAKE = 4_096
"""Captures waiting that wake kvobs's applier thread before its next round (kvobs/applier.py)."""
CAPTURE_LIMIT = 65_536
"""Captures the buffer holds at most (a few MiB of references): the thread that finds it full applies it
there and then, so nothing is dropped (``kvobs_capture_buffer_full_total`` counts the times)."""
APPLY_EVERY_S = 0.05
"""How often kvobs's applier thread applies what every observed manager captured."""
APPLY_BATCH = 2_048
"""Captures applied per hold of the GIL-bound apply loop: the scheduler thread waits for at most one."""
SNAPSHOT_EVERY_S = 0.25
"""The longest the sinks' counters lag one counted outside any drain (survive mode's recompute ledger): a
drain pushes them when it changed them, and at least this often (kvobs's applier drains every APPLY_EVERY_S)."""

# -- histogram buckets (residency and eviction age) ------------------------------------

BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 14400.0, 43200.0, 86400.0,
)
"""Histogram upper bounds in seconds: 1 ms to 1 day."""
