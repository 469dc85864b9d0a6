"""``observe()``: wrap any vLLM OffloadingManager, with the sinks the options ask for."""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import OffloadingManager

from kvobs.options import Options, parse_options
from kvobs.vllm import compat
from kvobs.vllm.evidence import observer_for
from kvobs.vllm.manager import ObservedOffloadingManager


def observe(manager: OffloadingManager, **options: Any) -> ObservedOffloadingManager:
    """Wrap ``manager``; see :class:`kvobs.options.Options` for the options.

    Raises ``kvobs.vllm.compat.ProtocolMismatch`` when kvobs does not know how to observe
    this manager on this vLLM release (the plugin steps aside instead).
    """
    return observe_with_options(manager, parse_options(options, source="kvobs.observe() option"))


def observe_with_options(manager: OffloadingManager, options: Options) -> ObservedOffloadingManager:
    """Refuse what is not a manager or is observed already, build the evidence
    (:func:`kvobs.vllm.evidence.observer_for`: protocol check, observer, sinks, policy hook), and wrap."""
    if not isinstance(manager, OffloadingManager):
        raise TypeError(f"kvobs.observe() needs a vLLM OffloadingManager, got {type(manager).__name__}")
    if isinstance(manager, ObservedOffloadingManager) or compat.is_hooked(manager):
        raise ValueError("this manager is already observed by kvobs")
    return ObservedOffloadingManager._kvobs_wrap(manager, observer_for(manager, options))
