"""The evidence kvobs keeps for one manager: its observer, sinks and cache-policy hook.

Apart from :mod:`kvobs.vllm.observe` so that the wrapper (:mod:`kvobs.vllm.manager`) can build a
copy's fresh evidence without importing ``observe``, which imports the wrapper: imports here go
one way, observe -> manager -> evidence.
"""

from __future__ import annotations

import dataclasses
import logging

from vllm.v1.kv_offload.base import OffloadingManager

from kvobs.observer import Observer
from kvobs.options import Options
from kvobs.vllm import compat

logger = logging.getLogger("kvobs")


def observer_for(manager: OffloadingManager, options: Options) -> Observer:
    """Check the protocol, build the observer and its sinks (the journal when ``dir`` is set,
    always the tracer), and hook the CPU tier's policy; ``manager`` is not observed yet."""
    compat.check(manager)
    if options.engine is None:  # one engine, as vLLM numbers a single engine: stable across restarts
        options = dataclasses.replace(options, engine="0")
    cpu = compat.cpu_tier_of(manager)
    observer = Observer(options, num_stamps=0 if cpu is None else compat.num_chunks(cpu))
    journal = None
    if options.dir is not None:
        from kvobs.journal import JournalSink, dir_warning, unusable_dir

        problem = unusable_dir(options.dir)  # tried for real, once: one WARNING, not a fault per write
        if problem is None:
            try:
                journal = JournalSink(options.dir, observer.options, compat.VLLM_VERSION)
                observer.add_sink(journal)
            except OSError as exc:  # an unusable directory must not stop the engine: said, in-process only
                problem = f"{type(exc).__name__}: {exc}"
        if problem is not None:
            observer.dir_problem = problem  # vllm_metrics: kvobs_unavailable{part="dir"} 1
            logger.warning("%s", dir_warning(observer.options, problem))
            observer.internal_error("journal", None, said=True)  # counted as before, logged once, above
    from kvobs.tracing import TracingSink

    observer.add_sink(TracingSink(options.tracer_provider, options.engine, options.model_name))
    if cpu is not None:
        compat.hook_policy(cpu, observer.recorder, stamp_inserts=observer.recorder.keep_residency)
    from kvobs.vllm.flight_recorder import answer_requests, start

    try:
        start(manager, observer)
    except Exception as exc:  # the recorder is kvobs's own: it never stops the rest
        observer.recorder.flight_off()
        observer.flight_off_reason = f"it failed to start: {exc!r}"
        observer.internal_error("flight", exc)
    if journal is not None:
        answer_requests(manager, observer, journal)
    return observer
