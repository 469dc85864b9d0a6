"""kvobs: makes vLLM's KV-cache offloading explain itself.

Public API: :func:`observe` (wrap an OffloadingManager) and, for vLLM's
``kv_connector_extra_config``, ``kvobs.vllm.ObservedOffloadingSpec``.
Importing ``kvobs`` does not import vLLM (the sidecar runs without it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

if TYPE_CHECKING:
    from kvobs.vllm.manager import ObservedOffloadingManager


def observe(manager: Any, **options: Any) -> ObservedOffloadingManager:
    """Wrap a vLLM OffloadingManager so its failed loads explain themselves.

    Options: ``history_size``, ``max_verdicts``, ``dir``, ``engine``,
    ``tracer_provider`` (see README). Unknown or ill-typed options raise
    ``kvobs.options.OptionError`` naming the option.
    """
    from kvobs.vllm.observe import observe as _observe

    return _observe(manager, **options)


__all__ = ["__version__", "observe"]
