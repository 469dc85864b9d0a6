"""Survive mode, vLLM side: a load that would assert for missing chunks becomes a recompute.

Opt-in (the ``survive`` option; README, "Survive instead of crash"). The manager's part
(:class:`Survival`, installed by ``kvobs/vllm/manager.py``): vLLM's ``prepare_load`` asserted on
the first chunk it cannot read, with the keys before it pinned; kvobs unpins them, pins and reads
them again through vLLM's own ``prepare_load`` (the present prefix loads as usual), and the load
tap returns that source padded with a filler slot for the rest (the manager's failure callback
decides, once: the assertion is caught once), so the connector's load job keeps its shape.
It remembers the keys it did not pin, so ``complete_load`` unpins only what was pinned; a
``reset_cache()`` forgets them (vLLM never completes a load from before a reset, and its manager
drops every pin there).

The connector's part (``kvobs/vllm/connector.py``, which arms it): with one KV cache group, the GPU
blocks from the first unreadable chunk on (what the filler wrote, and everything after it that
depends on it) go to the workers in the connector metadata, and each worker's
``get_block_ids_with_load_errors()`` reports them; vLLM's scheduler, with ``kv_load_failure_policy:
"recompute"``, truncates the request there and recomputes. With several groups (a hybrid model) the
request itself goes to the workers, which report it in ``failed_recving``: vLLM restarts it from
token 0, every group recomputed, and frees what the load wrote. A request recomputes at most once:
its later lookups load nothing, so nothing in this path can loop. What vLLM reads for all of it is
listed in ``kvobs/vllm/compat.py``.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

from kvobs.vllm import compat

if TYPE_CHECKING:  # the connector imports this module in vLLM's API server too: no recording side there
    from kvobs.observer import Observer, Unloadable

logger = logging.getLogger("kvobs")

SURVIVED_ATTRIBUTE = "kvobs_failed_block_ids"
"""The connector metadata's attribute carrying the GPU blocks to report as failed loads."""
SURVIVED_REQUESTS_ATTRIBUTE = "kvobs_failed_req_ids"
"""The connector metadata's attribute carrying the requests to report as failed loads (the
request-level path: a model with several KV cache groups)."""


class Survival:
    """Survive mode for one observed manager (see the module)."""

    def __init__(self, inner: Any, observer: Observer) -> None:
        self._inner = inner
        self._observer = observer
        self.armed = False
        self.not_armed = ("kvobs's connector did not arm it (kv_connector must be ObservedOffloadingConnector, "
                          "kv_connector_module_path kvobs.vllm.connector)")
        self._said_not_armed = False
        self._unpinned: Counter[Any] = Counter()
        self._first_unreadable: dict[str, int] = {}  # req_id -> index in its load's keys, for the connector
        self._spec: Any = None
        self.recomputed_requests: set[str] = set()
        """Requests whose load was recomputed: they load nothing more until they finish (no loop)."""

    # -- the manager's side ---------------------------------------------------

    def try_survive(self, keys: Sequence[Any], unloadable: Sequence[Unloadable], req_context: Any,
                    vllm_message: str) -> bool:
        """After vLLM's assertion: make the padded source (kept for :meth:`take_source`); whether it did.
        Never raises: on anything unexpected vLLM's assertion goes on, as without survive mode."""
        if not self.armed:
            if not self._said_not_armed:
                self._said_not_armed = True
                logger.warning("kvobs survive is on but not armed: %s; the load fails as vLLM fails it",
                               self.not_armed)
            return False
        req_id = req_context.req_id
        unreadable = {u.key for u in unloadable}
        first = next((i for i, key in enumerate(keys) if key in unreadable), None)
        if first is None or repr(keys[first]) not in vllm_message or req_id in self.recomputed_requests:
            return False  # not the chunk vLLM asserted on (what it pinned is unknown), or a second time
        try:
            present = list(keys[:first])
            if present:
                self._inner.complete_load(present, req_context)  # the pins the failed call took
            spec = self._inner.prepare_load(present, req_context)
            self._spec = compat.padded_load_spec(spec, len(keys) - first)
        except Exception as exc:  # vLLM's assertion goes on; the engine stops as without kvobs
            self.internal_error(exc)
            return False
        self._unpinned.update(keys[first:])
        self._first_unreadable[req_id] = first
        self.recomputed_requests.add(req_id)
        return True

    def take_source(self) -> Any:
        """The padded load source :meth:`try_survive` made, handed over once: what ``prepare_load`` returns
        instead of raising (the manager's failure callback returns it to the load tap)."""
        spec, self._spec = self._spec, None
        return spec

    def complete_through(self, complete: Callable[..., Any]) -> Callable[..., Any]:
        """``complete_load`` without the keys survive mode did not pin."""

        def complete_load(keys: Collection[Any], req_context: Any) -> Any:
            if self._unpinned:
                keys = [key for key in keys if not self._take_unpinned(key)]
            return complete(keys, req_context)

        return complete_load

    def reset_through(self, reset: Callable[[], Any]) -> Callable[[], Any]:
        """``reset_cache`` that also forgets the keys not pinned: vLLM never calls ``complete_load`` for a
        load from before a reset (its scheduler skips those jobs' reports) and the reset drops every
        pin, so a key kept here would filter a later load's real pin out of its ``complete_load`` and
        leave that chunk pinned for good (issue 31, class 1)."""

        def reset_cache() -> Any:
            try:
                return reset()
            finally:
                self._unpinned.clear()

        return reset_cache

    def _take_unpinned(self, key: Any) -> bool:
        if self._unpinned[key] <= 0:
            return False
        self._unpinned[key] -= 1
        if not self._unpinned[key]:
            del self._unpinned[key]
        return True

    # -- the connector's side ---------------------------------------------------

    def recomputed(self, tokens: int) -> None:
        """Count a load the connector reported to vLLM as failed, of ``tokens`` tokens."""
        self._observer.recomputes.recomputed(tokens)

    def internal_error(self, exc: BaseException) -> None:
        self._observer.internal_error("survive", exc)

    def take_first_unreadable(self, req_id: str) -> int | None:
        """The index of the first unreadable key of the load just recomputed for ``req_id``, if one was."""
        return self._first_unreadable.pop(req_id, None)

    def finished(self, req_id: str) -> None:
        self.recomputed_requests.discard(req_id)
        self._first_unreadable.pop(req_id, None)


def failed_blocks(first_unreadable: int, dst_block_ids: Sequence[int], first_block_index: int,
                  blocks_per_chunk: int) -> list[int]:
    """The GPU blocks of a load from its first unreadable chunk on: that chunk's first block in the
    request, or the load's first block when the load entered that chunk part-way."""
    first_chunk = first_block_index // blocks_per_chunk
    start = max(0, (first_chunk + first_unreadable) * blocks_per_chunk - first_block_index)
    return list(dst_block_ids[start:])
