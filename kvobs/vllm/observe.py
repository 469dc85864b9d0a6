"""``observe()``: wrap any vLLM OffloadingManager, with the sinks the options ask for."""

from __future__ import annotations

import dataclasses
import os
from importlib import metadata
from typing import Any

from vllm.v1.kv_offload.base import OffloadingManager

from kvobs.observer import Observer
from kvobs.options import Options, parse_options
from kvobs.vllm.manager import ObservedOffloadingManager, cpu_tier_of


def observe(manager: OffloadingManager, **options: Any) -> ObservedOffloadingManager:
    """Wrap ``manager``; see :class:`kvobs.options.Options` for the options."""
    return observe_with_options(manager, parse_options(options, source="kvobs.observe() option"))


def vllm_version() -> str:
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return "unknown"


def observe_with_options(manager: OffloadingManager, options: Options) -> ObservedOffloadingManager:
    """Build the observer and its sinks: the journal when ``dir`` is set, always the tracer."""
    if not isinstance(manager, OffloadingManager):
        raise TypeError(f"kvobs.observe() needs a vLLM OffloadingManager, got {type(manager).__name__}")
    if isinstance(manager, ObservedOffloadingManager):
        raise ValueError("this manager is already observed by kvobs")
    if options.engine is None:
        options = dataclasses.replace(options, engine=f"pid{os.getpid()}")
    cpu = cpu_tier_of(manager)
    observer = Observer(options, num_stamps=0 if cpu is None else int(cpu._num_chunks))
    if options.dir is not None:
        from kvobs.journal import JournalSink

        try:
            observer.sinks.append(JournalSink(options.dir, observer, vllm_version()))
        except OSError as exc:  # an unusable directory must not stop the engine: counted, logged, in-process only
            observer.internal_error("journal", exc)
    from kvobs.tracing import TracingSink

    observer.sinks.append(TracingSink(options.tracer_provider))
    return ObservedOffloadingManager(manager, observer)
