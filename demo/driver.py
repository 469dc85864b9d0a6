"""Drive the installed vLLM's real ``OffloadingConnectorScheduler`` on CPU, one engine step at a time.

Why: kvobs must be tested against the way vLLM actually calls an ``OffloadingManager``
(lookup pass, one ``prepare_load`` per request, stores and ``on_schedule_end`` in
``build_connector_meta``, completions in ``update_connector_output``). This module builds the
real config objects (kvobs/vllm/modelless_config.py, which ``kvobs doctor`` builds from too), the
real spec (``OffloadingSpecFactory``) and the real connector scheduler, and plays the part of
``vllm.v1.core.sched.scheduler.Scheduler`` for the connector hooks.

What is real: ``VllmConfig`` (model-less), ``KVCacheConfig`` / ``FullAttentionSpec`` /
``SlidingWindowSpec``, vLLM's ``build_offloading_config``, the spec and its manager (including
the tiering manager, its ``/dev/shm`` region and the in-memory "example" secondary tier),
``Request`` with vLLM's own block hasher, ``KVCacheBlocks``, ``SchedulerOutput``,
``KVConnectorOutput``.

What is not: the few ``ModelConfig`` members that ``build_offloading_config`` reads (see
``kvobs.vllm.modelless_config.ModelFacts``), GPU block allocation (a counter, ids never reused; block 0
is vLLM's null block), and the worker side, whose only effect on the scheduler is the job-completion report
sent by ``EngineStepDriver.report_worker_jobs``.

Used by ``kvobs demo`` and by the integration tests. A failed ``prepare_load`` kills vLLM's
engine; the driver can instead hand it to ``on_load_failure`` and drop that request, so that a
demo can show many failures in one run.
"""

from __future__ import annotations

import functools
import itertools
import mmap
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm import SamplingParams
from vllm.config import CacheConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
    TransferStats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    OffloadingConnectorScheduler,
)
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    KVCacheBlock,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData
from vllm.v1.kv_cache_interface import KVCacheConfig, SlidingWindowSpec
from vllm.v1.kv_offload.base import OffloadingSpec, OffloadKey, make_offload_key
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from kvobs.vllm import compat
from kvobs.vllm.modelless_config import BLOCK_SIZE, make_kv_cache_config, make_offloading_config, make_vllm_config


def cpu_bytes_for_chunks(offloading_config: OffloadingConfig, num_chunks: int) -> int:
    """``cpu_bytes_to_use`` giving exactly ``num_chunks`` CPU chunks (CPU/Tiering sizing rule).

    A spec class without ``BLOCK_SIZE_ALIGNMENT`` (e.g. a wrapper by composition) is assumed
    to size an inner CPU/Tiering spec, which pads each chunk to a memory page.
    """
    spec_cls = OffloadingSpecFactory.get_spec_cls(offloading_config.extra_config)
    alignment = int(getattr(spec_cls, "BLOCK_SIZE_ALIGNMENT", mmap.PAGESIZE))
    chunk_bytes = (
        offloading_config.worker_kv_bytes_per_block
        * offloading_config.parallel.world_size
        * offloading_config.cache.blocks_per_chunk
    )
    return -(-chunk_bytes // alignment) * alignment * num_chunks


def build_scheduler(
    extra_config: Mapping[str, Any],
    *,
    hybrid: bool,
    num_full_groups: int = 1,
    num_sliding_groups: int = 1,
    extra_retained_tokens: int = 0,
    num_cpu_chunks: int | None = None,
) -> tuple[OffloadingConnectorScheduler, OffloadingSpec, KVCacheConfig]:
    """Build the spec and the connector scheduler the way ``OffloadingConnector`` does.

    ``extra_config`` is ``kv_connector_extra_config`` (``spec_name``, ``spec_module_path``,
    ``secondary_tiers``, ...). ``num_cpu_chunks`` overrides ``cpu_bytes_to_use`` so that the
    CPU (primary) tier holds exactly that many chunks: a small value makes eviction easy.
    The caller owns shutdown: ``scheduler.shutdown()`` frees the manager (and its /dev/shm).
    """
    kv_cache_config = make_kv_cache_config(
        hybrid=hybrid, num_full_groups=num_full_groups, num_sliding_groups=num_sliding_groups,
        extra_retained_tokens=extra_retained_tokens,
    )
    extra = dict(extra_config)
    if num_cpu_chunks is not None:
        probe = make_offloading_config(make_vllm_config(extra), kv_cache_config)
        extra["cpu_bytes_to_use"] = cpu_bytes_for_chunks(probe, num_cpu_chunks)
    vllm_config = make_vllm_config(extra)
    spec = OffloadingSpecFactory.create_spec(make_offloading_config(vllm_config, kv_cache_config))
    actual = getattr(spec, "num_chunks", num_cpu_chunks)
    if num_cpu_chunks is not None and actual != num_cpu_chunks:
        raise ValueError(f"spec sized {actual} CPU chunks, wanted {num_cpu_chunks}")
    scheduler = OffloadingConnectorScheduler(spec, vllm_config, kv_cache_config)
    return scheduler, spec, kv_cache_config


@functools.cache
def _block_hasher() -> Callable[[Request], list[BlockHash]]:
    """vLLM's request block hasher with the default algorithm, as EngineCore sets it up."""
    hash_fn = get_hash_fn_by_name(CacheConfig().prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(BLOCK_SIZE, hash_fn)


def make_request(
    request_id: str,
    prompt_token_ids: Sequence[int],
    *,
    skip_reading_prefix_cache: bool = False,
    max_tokens: int = 1024,
) -> Request:
    """A real ``Request`` whose block hashes come from vLLM's hasher (sha256, the default)."""
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=SamplingParams(
            max_tokens=max_tokens,
            skip_reading_prefix_cache=skip_reading_prefix_cache,
        ),
        pooling_params=None,
        block_hasher=_block_hasher(),
    )


@dataclass
class _ReqState:
    request: Request
    block_ids: list[list[int]]  # per KV cache group; 0 is the null block


@dataclass
class EngineStepDriver:
    """Plays vLLM's ``Scheduler`` for the connector scheduler's hooks.

    Per ``step()``: every running request decodes one token, requests whose load was reported
    done prefill the rest of their prompt, and each waiting request (admitted now, or deferred
    by the connector earlier) is looked up (``get_num_new_matched_tokens``), given GPU blocks,
    passed to ``update_state_after_alloc`` and either prefilled whole or parked until its async
    load is reported done; then ``build_connector_meta`` runs with that step's
    ``SchedulerOutput`` (including requests finished since the last step), and the step's
    tokens are "computed".
    """

    scheduler: OffloadingConnectorScheduler
    kv_cache_config: KVCacheConfig
    num_external_tokens: dict[str, int | None] = field(default_factory=dict)
    """Per request: the last ``get_num_new_matched_tokens`` hit (None = deferred)."""
    allocator_retained_tokens: int = 0
    """Sliding-window tokens the (simulated) allocator keeps below the window beyond what the
    ``KVCacheConfig`` given to the connector declares (its ``extra_retained_tokens``). Non-zero
    models an allocator/connector range disagreement, like vLLM #56701 (MTP retained history,
    fixed in 0.31): the load then covers a chunk the lookup never checked."""
    spec_tokens: int = 0
    """Draft tokens each decode step schedules beyond its one token (MTP or n-gram speculation): blocks are
    allocated for them and ``build_connector_meta`` sees them in ``scheduled_spec_decode_tokens``; of them
    ``accepted(req_id)`` are accepted (all when it is None), as vLLM's rejection sampler decides."""
    accepted: Callable[[str], int] | None = None
    on_load_failure: Callable[[AssertionError, Request], None] | None = None
    """Called with a failed load's assertion instead of raising it (vLLM's engine would die);
    the request is then dropped as if aborted, and the step goes on."""
    failed_req_ids: list[str] = field(default_factory=list)
    _reqs: dict[str, _ReqState] = field(default_factory=dict)
    _running: list[str] = field(default_factory=list)
    _loading: dict[str, int] = field(default_factory=dict)  # req_id -> load job id
    _loaded: list[str] = field(default_factory=list)  # load done, waiting to prefill
    _deferred: list[Request] = field(default_factory=list)  # lookup said "ask again"
    _finished: set[str] = field(default_factory=set)  # to report in the next step
    _pending_jobs: dict[int, str] = field(default_factory=dict)  # job id -> req id
    _next_block_id: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    @property
    def running(self) -> list[Request]:
        """Requests decoding now (their prefill ran)."""
        return [self._reqs[req_id].request for req_id in self._running]

    @property
    def pending_job_ids(self) -> list[int]:
        """Transfer jobs handed to the (simulated) workers and not yet reported."""
        return list(self._pending_jobs)

    def add_request(self, request: Request) -> None:
        """``Scheduler.add_request``: the connector sees the request before any lookup."""
        self.scheduler.on_new_request(request)
        num_groups = len(self.kv_cache_config.kv_cache_groups)
        self._reqs[request.request_id] = _ReqState(request, [[] for _ in range(num_groups)])

    def step(self, admit: Iterable[Request] = ()) -> OffloadingConnectorMetadata:
        """One engine step. ``admit``: waiting requests to schedule (added first if new)."""
        admit = list(admit)
        for request in admit:  # Scheduler.add_request runs before, not inside, schedule()
            if request.request_id not in self._reqs:
                self.add_request(request)
        try:
            meta = self._step(admit)
        except BaseException:
            # vLLM's engine dies here; the harness goes on, so hand the manager lock back
            # (the step region opened by the first lookup would otherwise stay held).
            compat.release_step(self.scheduler)
            raise
        self.settle()
        return meta

    def settle(self) -> None:
        """The model step's duration: the secondary tiers' I/O and async lookups finish meanwhile.

        A real engine spends tens of milliseconds in the model between two scheduler steps, in
        which vLLM's fs tier threads complete their transfers and answer the lookups the step
        posted; the harness waits for exactly that instead of sleeping, so replays are
        deterministic.
        """
        compat.settle_secondary_tiers(self.scheduler.manager)

    def _step(self, admit: list[Request]) -> OffloadingConnectorMetadata:
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData.make_empty()
        drafts: dict[str, list[int]] = {}

        for req_id in self._running:  # decode: one token, and the drafts of speculation
            state = self._reqs[req_id]
            new_ids = self._allocate(state, state.request.num_computed_tokens + 1 + self.spec_tokens)
            cached.req_ids.append(req_id)
            cached.new_block_ids.append(new_ids if any(new_ids) else None)
            cached.num_computed_tokens.append(state.request.num_computed_tokens)
            cached.num_output_tokens.append(state.request.num_output_tokens)
            num_scheduled[req_id] = 1 + self.spec_tokens
            if self.spec_tokens:
                drafts[req_id] = [0] * self.spec_tokens

        for req_id in self._loaded:  # async load finished: prefill the rest
            request = self._reqs[req_id].request
            request.status = RequestStatus.WAITING
            if request.num_computed_tokens == request.num_tokens:  # recompute the last token
                request.num_computed_tokens -= 1
            self._admit(self._reqs[req_id], request.num_computed_tokens, num_scheduled, new_reqs)
        self._loaded.clear()

        waiting, self._deferred = [*self._deferred, *admit], []
        for request in waiting:
            state = self._reqs[request.request_id]
            hit, load_async = self.scheduler.get_num_new_matched_tokens(request, 0)
            self.num_external_tokens[request.request_id] = hit
            if hit is None:  # the connector asked to be asked again in a later step
                self._deferred.append(request)
                continue
            if load_async:
                self._allocate(state, hit)
                try:
                    self.scheduler.update_state_after_alloc(request, self._blocks(state), hit)
                except AssertionError as exc:
                    if self.on_load_failure is None:
                        raise
                    self.on_load_failure(exc, request)
                    self._drop(request)
                    continue
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                request.num_computed_tokens = hit
                continue
            self._admit(state, 0, num_scheduled, new_reqs)

        output = compat.scheduler_output(
            len(self.kv_cache_config.kv_cache_groups),
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            scheduled_spec_decode_tokens=drafts,
            scheduled_encoder_inputs={},
            finished_req_ids=set(self._finished),
            free_encoder_mm_hashes=[],
        )
        self._finished.clear()
        meta = self.scheduler.build_connector_meta(output)
        assert isinstance(meta, OffloadingConnectorMetadata)
        for job_id, job in (meta.load_jobs | meta.store_jobs).items():
            self._pending_jobs[job_id] = job.req_id
        for job_id, job in meta.load_jobs.items():
            self._loading[job.req_id] = job_id
        self._execute(num_scheduled, drafts)
        return meta

    def _admit(
        self,
        state: _ReqState,
        num_computed: int,
        num_scheduled: dict[str, int],
        new_reqs: list[NewRequestData],
    ) -> None:
        """Schedule a waiting request's whole remaining prompt as one prefill chunk."""
        request = state.request
        self._allocate(state, request.num_tokens)
        self.scheduler.update_state_after_alloc(request, self._blocks(state), 0)
        request.status = RequestStatus.RUNNING
        num_scheduled[request.request_id] = request.num_tokens - num_computed
        new_reqs.append(compat.new_request_data(request, tuple(list(b) for b in state.block_ids)))

    def _drop(self, request: Request) -> None:
        """Abort a request whose load failed: the connector forgets it at the next step."""
        self.failed_req_ids.append(request.request_id)
        request.status = RequestStatus.FINISHED_ABORTED
        self.scheduler.request_finished(request)
        self._finished.add(request.request_id)

    def _execute(self, num_scheduled: Mapping[str, int], drafts: Mapping[str, list[int]]) -> None:
        """The model "ran": advance computed tokens and sample one token per request, plus its accepted drafts
        (the rejected ones are not computed: vLLM takes them back off ``num_computed_tokens``)."""
        for req_id, n in num_scheduled.items():
            request = self._reqs[req_id].request
            proposed = len(drafts.get(req_id, ()))
            accepted = proposed if self.accepted is None or not proposed else min(proposed, self.accepted(req_id))
            request.num_computed_tokens += n - (proposed - accepted)
            for _ in range(1 + accepted):
                request.append_output_token_ids(0)
            if req_id not in self._running:
                self._running.append(req_id)

    def _allocate(self, state: _ReqState, num_tokens: int) -> tuple[list[int], ...]:
        """Extend each group's block table to cover ``num_tokens``; return the new ids.

        Like vLLM's sliding-window manager, blocks wholly outside the window of an
        externally computed prefix are the null block (id 0).
        """
        new_ids: list[list[int]] = []
        for group, table in zip(self.kv_cache_config.kv_cache_groups, state.block_ids, strict=True):
            num_blocks = -(-num_tokens // BLOCK_SIZE)
            skipped = 0
            if isinstance(group.kv_cache_spec, SlidingWindowSpec) and not table:
                spec = group.kv_cache_spec
                retained = spec.extra_retained_tokens + self.allocator_retained_tokens
                skipped = max(0, num_tokens - spec.sliding_window + 1 - retained) // BLOCK_SIZE
            added = [0 if i < skipped else next(self._next_block_id) for i in range(len(table), num_blocks)]
            table.extend(added)
            new_ids.append(added)
        return tuple(new_ids)

    def _blocks(self, state: _ReqState) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([KVCacheBlock(bid, is_null=bid == 0) for bid in table] for table in state.block_ids))

    def finish(self, request: Request) -> None:
        """A running request stopped after its last step (``Scheduler._free_request``)."""
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        self._running.remove(request.request_id)
        self.scheduler.request_finished(request)
        self._finished.add(request.request_id)

    def report_worker_jobs(self, job_ids: Iterable[int], transfer_stats: TransferStats | None = None,
                           *, failed: Collection[int] = ()) -> None:
        """SIMULATED worker side: every worker reports these transfer jobs as done (those in
        ``failed`` as failed, vLLM 0.34's ``OffloadingWorkerMetadata.failed_jobs``).

        This is the only simulated vLLM behaviour. The GPU worker cannot run on CPU; all the
        scheduler learns from it is ``OffloadingWorkerMetadata.completed_jobs`` (one count per
        worker) and, for a finished load, the request id in ``finished_recving``. No KV bytes
        move, which the scheduler side cannot observe. ``transfer_stats`` (also simulated when
        given) feeds vLLM's load/store byte counters.
        """
        completed: dict[int, int] = {}
        finished_recving: set[str] = set()
        num_workers = self.scheduler.config.num_workers
        for job_id in job_ids:
            req_id = self._pending_jobs.pop(job_id)
            completed[job_id] = num_workers
            if self._loading.get(req_id) == job_id:
                del self._loading[req_id]
                finished_recving.add(req_id)
                self._loaded.append(req_id)
        self.scheduler.update_connector_output(
            KVConnectorOutput(
                finished_recving=finished_recving or None,
                kv_connector_worker_meta=compat.worker_metadata(
                    OffloadingWorkerMetadata, completed, set(failed), transfer_stats or TransferStats()
                ),
            )
        )
        self.settle()

    def report_all_worker_jobs(self) -> None:
        """``report_worker_jobs`` for every job still pending."""
        self.report_worker_jobs(self.pending_job_ids)


def offload_key(request: Request, chunk_idx: int, group_idx: int) -> OffloadKey:
    """The key the connector uses for ``request``'s chunk ``chunk_idx`` of a group."""
    return make_offload_key(request.block_hashes[chunk_idx], group_idx)


