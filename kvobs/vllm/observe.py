"""``observe()``: wrap any vLLM OffloadingManager."""

from __future__ import annotations

import os
from typing import Any

from vllm.v1.kv_offload.base import OffloadingManager

from kvobs.observer import Observer, Sink
from kvobs.options import Options, parse_options
from kvobs.vllm.manager import ObservedOffloadingManager


def observe(manager: OffloadingManager, **options: Any) -> ObservedOffloadingManager:
    """Wrap ``manager``; see :class:`kvobs.options.Options` for the options."""
    return observe_with_options(manager, parse_options(options, source="kvobs.observe() option"))


def observe_with_options(manager: OffloadingManager, options: Options) -> ObservedOffloadingManager:
    if not isinstance(manager, OffloadingManager):
        raise TypeError(f"kvobs.observe() needs a vLLM OffloadingManager, got {type(manager).__name__}")
    if isinstance(manager, ObservedOffloadingManager):
        raise ValueError("this manager is already observed by kvobs")
    if options.engine is None:
        options = Options(**{**options.__dict__, "engine": f"pid{os.getpid()}"})
    sinks: list[Sink] = []
    return ObservedOffloadingManager(manager, Observer(options, sinks))
