"""ObservedOffloadingConnector: vLLM's OffloadingConnector plus what only the connector knows.

Use it instead of ``OffloadingConnector`` (``"kv_connector": "ObservedOffloadingConnector",
"kv_connector_module_path": "kvobs.vllm.connector"``) to make kvobs's failure span join the
request's trace, and to label kvobs's series with the served model name
(``--served-model-name``; the spec alone sees only the model path). With the ``survive`` option it
also arms survive mode (kvobs/vllm/survive.py): it reports the blocks of a recomputed load to vLLM as
failed loads (one KV cache group), or the request itself (several), the ways a connector tells vLLM's
scheduler to recompute; and answers "no hit" for a lookup that raised, so vLLM computes the prefix
itself. Every exception leaving vLLM's code through its scheduler- and worker-side methods is reported
before it propagates unchanged (kvobs/vllm/boundary.py). Everything else is vLLM's.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from kvobs.options import OptionError
from kvobs.vllm import compat
from kvobs.vllm.boundary import boundary_of, guard, observer_of
from kvobs.vllm.survive import SURVIVED_ATTRIBUTE, SURVIVED_REQUESTS_ATTRIBUTE, Survival, failed_blocks
from kvobs.vllm.trace_context import TraceHeaders

logger = logging.getLogger("kvobs")


@guard  # every scheduler- and worker-side method: an exception leaving is reported, then re-raised (boundary.py)
class ObservedOffloadingConnector(OffloadingConnector):
    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        served = compat.SERVED_MODEL_NAME.set(compat.served_name_of(vllm_config))
        try:
            super().__init__(vllm_config, *args, **kwargs)  # builds the spec: kvobs.vllm.spec reads the name
        finally:
            compat.SERVED_MODEL_NAME.reset(served)
        self._kvobs_survival: Survival | None = None
        self._kvobs_failed_blocks: set[int] = set()  # scheduler: for the next metadata; worker: to report
        self._kvobs_failed_requests: set[str] = set()  # the same, for the request-level path (several groups)
        self._kvobs_request_level = False
        self._kvobs_block_size = int(vllm_config.cache_config.block_size)
        observer = observer_of(self)
        if observer is not None:
            observer.guarded = True  # this boundary reports what leaves the manager (with the requests' lifecycle)
        if self.connector_scheduler is not None:
            try:
                self._kvobs_survival, self._kvobs_request_level = _arm_survival(
                    self.connector_scheduler, vllm_config, args, kwargs)
            except OptionError:
                self.shutdown()  # start-up stops here: the manager built above is released first
                raise

    def on_new_request(self, request: Any) -> None:
        super().on_new_request(request)
        headers = getattr(request, "trace_headers", None)
        if not headers or self.connector_scheduler is None:
            return
        req_context = compat.request_context(self.connector_scheduler, request.request_id)
        if req_context is not None:
            req_context.set_state(TraceHeaders(dict(headers)))

    # -- survive mode: the scheduler's side -------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        survival = self._kvobs_survival
        try:
            matched = super().get_num_new_matched_tokens(request, *args, **kwargs)
        except Exception as exc:
            if survival is None:
                raise  # the guard reports it (boundary.py)
            # Survive mode: no hit. The lookup made no transfer (a load job is made by update_state_after_alloc,
            # which vLLM then calls with 0 external tokens), so vLLM computes the prefix itself: outputs as
            # without offloading. Reported as at the boundary, at WARNING; counted as a recomputed load.
            boundary_of(self).left("get_num_new_matched_tokens", exc, (request, *args), recomputed=True)
            try:
                survival.recomputed(0)  # no tokens: the lookup never said how many it would have loaded
            except Exception as fault:  # kvobs's own: counted; the answer stands
                survival.internal_error(fault)
            return 0, False
        if survival is not None and request.request_id in survival.recomputed_requests:
            return 0, False  # a request recomputes once, then loads nothing more: no loop
        return matched

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> Any:
        result = super().update_state_after_alloc(request, blocks, num_external_tokens)
        survival = self._kvobs_survival
        first_unreadable = None if survival is None else survival.take_first_unreadable(request.request_id)
        if first_unreadable is not None and self._kvobs_request_level:
            assert survival is not None  # the whole request restarts: every token of the load recomputed
            self._kvobs_failed_requests.add(request.request_id)
            survival.recomputed(num_external_tokens)
        elif first_unreadable is not None:
            assert self.connector_scheduler is not None and survival is not None
            try:
                dst, first_index, per_chunk = compat.load_destination(self.connector_scheduler, request.request_id)
                failed = failed_blocks(first_unreadable, dst, first_index, per_chunk)
            except Exception as exc:  # then every block of the request: more recomputed, nothing wrong kept
                survival.internal_error(exc)
                failed = [block.block_id for block in blocks.blocks[0] if not block.is_null]
            self._kvobs_failed_blocks.update(failed)
            tokens = min(num_external_tokens, len(failed) * self._kvobs_block_size)
            survival.recomputed(tokens)
        return result

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        if self._kvobs_failed_blocks:
            setattr(meta, SURVIVED_ATTRIBUTE, frozenset(self._kvobs_failed_blocks))
            self._kvobs_failed_blocks = set()
        if self._kvobs_failed_requests:
            setattr(meta, SURVIVED_REQUESTS_ATTRIBUTE, frozenset(self._kvobs_failed_requests))
            self._kvobs_failed_requests = set()
        return meta

    def request_finished(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        if self._kvobs_survival is not None:
            self._kvobs_survival.finished(request.request_id)
        return super().request_finished(request, *args, **kwargs)

    def request_finished_all_groups(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        if self._kvobs_survival is not None:
            self._kvobs_survival.finished(request.request_id)
        return super().request_finished_all_groups(request, *args, **kwargs)

    # -- survive mode: each worker's side -------------------------------------------

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        failed = getattr(connector_metadata, SURVIVED_ATTRIBUTE, None)
        if failed:
            self._kvobs_failed_blocks.update(failed)
        failed_requests = getattr(connector_metadata, SURVIVED_REQUESTS_ATTRIBUTE, None)
        if failed_requests:
            self._kvobs_failed_requests.update(failed_requests)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._kvobs_failed_blocks = self._kvobs_failed_blocks, set()
        return failed | super().get_block_ids_with_load_errors()

    def get_transfer_results(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's results (0.34), plus the requests survive mode failed: reported in the step their
        load was submitted, while vLLM still holds them waiting for it (``WAITING_FOR_REMOTE_KVS``)."""
        results = super().get_transfer_results(*args, **kwargs)
        if self._kvobs_failed_requests:
            results.failed_recving = set(results.failed_recving or ()) | self._kvobs_failed_requests
            self._kvobs_failed_requests = set()
        return results


def _arm_survival(connector_scheduler: Any, vllm_config: Any, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> tuple[Survival | None, bool]:
    """Survive mode's state when the ``survive`` option is on and this engine can recompute a failed
    load, and whether it reports whole requests (several KV cache groups, vLLM 0.34) rather than
    blocks; an OptionError naming the setting when it cannot (refused at start-up, never at a load)."""
    manager = getattr(connector_scheduler, "manager", None)
    survival = getattr(manager, "survival", None)
    options = getattr(getattr(manager, "observer", None), "options", None)
    if options is None or not options.survive:
        return None, False  # off, or kvobs stepped aside (it said so)
    if survival is None:
        raise OptionError("kvobs option 'survive' needs a manager whose CPU tier kvobs knows (vLLM's "
                          "CPUOffloadingSpec or TieringOffloadingSpec as the inner spec)")
    policy = compat.load_failure_policy(vllm_config)
    if policy != "recompute":
        raise OptionError(
            f"kvobs option 'survive' needs vLLM's kv_load_failure_policy \"recompute\" in --kv-transfer-config "
            f"(it is {policy!r}): with \"fail\" vLLM fails the request instead of recomputing it"
        )
    kv_cache_config = kwargs.get("kv_cache_config", args[1] if len(args) > 1 else None)
    groups = None if kv_cache_config is None else compat.kv_cache_groups(kv_cache_config)
    request_level = groups is not None and groups > 1 and compat.reports_failed_requests()
    if groups != 1 and not request_level:
        raise OptionError(
            f"kvobs option 'survive' needs a model with one KV cache group (this one has {groups}) on vLLM "
            f"{compat.VLLM_VERSION}: its scheduler maps failed-load blocks back to requests only then "
            "(Scheduler._handle_invalid_blocks) and cannot restart a whole request (Scheduler._handle_failed_recving)"
        )
    if request_level and compat.sync_load_budget(connector_scheduler):
        raise OptionError(
            "kvobs option 'survive' with several KV cache groups recomputes whole requests, which vLLM does "
            "only for asynchronous loads: leave the connector's sync_load_budget_bytes at 0"
        )
    missing = compat.survive_mismatch(connector_scheduler)
    if missing is not None:
        raise OptionError(f"kvobs option 'survive' does not know this vLLM's connector (no {missing})")
    survival.armed = True
    logger.info("kvobs survive armed: a load that finds chunks missing is recomputed (%s), the engine goes on",
                "the whole request" if request_level else "from the first missing block")
    return survival, request_level
