"""vLLM's config objects for offloading, built without a model: what vLLM's offloading code is built from.

``make_offloading_config`` is vLLM's own ``build_offloading_config`` (as ``OffloadingConnector.__init__``
calls it) over a ``VllmConfig`` whose ``model_config`` is :class:`ModelFacts`, a few facts of a small
model, and a ``KVCacheConfig`` of full-attention and, for a hybrid model, sliding-window groups
(``make_kv_cache_config``). ``kvobs doctor`` builds the configured inner spec's manager from them; the
demo's engine driver (demo/driver.py, in the source repository) and the tests build vLLM's real connector
scheduler from them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    build_offloading_config,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_offload.config import OffloadingConfig

BLOCK_SIZE = 16
"""Tokens per GPU block, per block hash and (blocks_per_chunk=1) per offloaded chunk."""
SLIDING_WINDOW = 32
"""Tokens; a 2-chunk window, so a sliding-window hit needs 2 consecutive chunk hits."""
FA_GROUP = 0
"""KV cache group of the full-attention layer (group order as in kv_cache_groups)."""
SW_GROUP = 1
"""KV cache group of the sliding-window layer (hybrid configs only)."""

_NUM_KV_HEADS = 2
_HEAD_SIZE = 8
_DTYPE = torch.float16


@dataclass(frozen=True)
class ModelFacts:
    """Stand-in for ``ModelConfig``, passed only to ``build_offloading_config``.

    A real ``ModelConfig`` needs an HF ``config.json`` and inspects the model class by importing
    it, which pulls GPU-only dependencies this CPU venv does not have (and the hub is
    unreachable). ``build_offloading_config`` reads exactly these members; the scheduler itself
    never reads ``model_config``.
    """

    model: str = "kvobs/cpu-harness"
    dtype: torch.dtype = _DTYPE
    max_model_len: int = 4096
    use_mla: bool = False

    def get_total_num_kv_heads(self) -> int:
        return _NUM_KV_HEADS


class WithModelFacts:
    """Read-through view of a ``VllmConfig`` whose ``model_config`` is ``ModelFacts``."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self._vllm_config = vllm_config
        self.model_config = ModelFacts()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._vllm_config, name)


def make_kv_cache_config(
    *,
    hybrid: bool,
    num_full_groups: int = 1,
    num_sliding_groups: int = 1,
    extra_retained_tokens: int = 0,
    num_gpu_blocks: int = 4096,
) -> KVCacheConfig:
    """``num_full_groups`` full-attention groups, then ``num_sliding_groups`` sliding-window groups
    when ``hybrid`` (a Gemma-style model: one full-attention group, five sliding-window ones).

    Same block size in every group, as vLLM's hybrid allocator produces. No ``kv_cache_tensors``:
    the per-block byte size then comes from the group page sizes. ``extra_retained_tokens`` is
    the sliding-window spec's own (MTP retained history; vLLM < 0.31's connector ignores it).
    """
    groups = [
        KVCacheGroupSpec(
            [f"model.layers.{i}.self_attn"],
            FullAttentionSpec(
                block_size=BLOCK_SIZE,
                num_kv_heads=_NUM_KV_HEADS,
                head_size=_HEAD_SIZE,
                dtype=_DTYPE,
            ),
        )
        for i in range(num_full_groups)
    ]
    if hybrid:
        window: dict[str, Any] = {"extra_retained_tokens": extra_retained_tokens} if extra_retained_tokens else {}
        groups.extend(
            KVCacheGroupSpec(
                [f"model.layers.{num_full_groups + i}.self_attn"],
                SlidingWindowSpec(
                    block_size=BLOCK_SIZE,
                    num_kv_heads=_NUM_KV_HEADS,
                    head_size=_HEAD_SIZE,
                    dtype=_DTYPE,
                    sliding_window=SLIDING_WINDOW,
                    **window,
                ),
            )
            for i in range(num_sliding_groups)
        )
    return KVCacheConfig(num_blocks=num_gpu_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def make_vllm_config(extra_config: Mapping[str, Any]) -> VllmConfig:
    """A model-less CPU ``VllmConfig`` with the OffloadingConnector configured.

    Prefix caching on and ``prefix_cache_retention_interval`` left at its default (0), as in
    ``vllm serve``; the latter decides which sliding-window chunks get stored.
    """
    return VllmConfig(
        device_config=DeviceConfig("cpu"),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=dict(extra_config),
        ),
    )


def make_offloading_config(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> OffloadingConfig:
    """vLLM's own ``build_offloading_config`` (as ``OffloadingConnector.__init__`` calls it)."""
    return build_offloading_config(
        WithModelFacts(vllm_config),  # type: ignore[arg-type]
        kv_cache_config,
    )
