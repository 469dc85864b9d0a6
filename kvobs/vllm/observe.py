"""``observe()``: wrap any vLLM OffloadingManager, with the sinks the options ask for."""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.v1.kv_offload.base import OffloadingManager

from kvobs.observer import Observer
from kvobs.options import Options, parse_options
from kvobs.vllm import compat
from kvobs.vllm.manager import ObservedOffloadingManager


def observe(manager: OffloadingManager, **options: Any) -> ObservedOffloadingManager:
    """Wrap ``manager``; see :class:`kvobs.options.Options` for the options.

    Raises ``kvobs.vllm.compat.ProtocolMismatch`` when kvobs does not know how to observe
    this manager on this vLLM release (the plugin steps aside instead).
    """
    return observe_with_options(manager, parse_options(options, source="kvobs.observe() option"))


def observe_with_options(manager: OffloadingManager, options: Options) -> ObservedOffloadingManager:
    """Check the protocol, build the observer and its sinks (the journal when ``dir`` is set,
    always the tracer), hook the CPU tier's policy, and wrap."""
    if not isinstance(manager, OffloadingManager):
        raise TypeError(f"kvobs.observe() needs a vLLM OffloadingManager, got {type(manager).__name__}")
    if isinstance(manager, ObservedOffloadingManager) or compat.is_hooked(manager):
        raise ValueError("this manager is already observed by kvobs")
    compat.check(manager)
    if options.engine is None:  # one engine, as vLLM numbers a single engine: stable across restarts
        options = dataclasses.replace(options, engine="0")
    cpu = compat.cpu_tier_of(manager)
    observer = Observer(options, num_stamps=0 if cpu is None else compat.num_chunks(cpu))
    if options.dir is not None:
        from kvobs.journal import JournalSink

        try:
            observer.add_sink(JournalSink(options.dir, observer, compat.VLLM_VERSION))
        except OSError as exc:  # an unusable directory must not stop the engine: counted, logged, in-process only
            observer.internal_error("journal", exc)
    from kvobs.tracing import TracingSink

    observer.add_sink(TracingSink(options.tracer_provider))
    if cpu is not None:
        compat.hook_policy(cpu, observer.recorder, stamp_inserts=observer.recorder.keep_residency)
    return ObservedOffloadingManager(manager, observer)
