"""kvobs's demo defects (kvobs/demo/defects.py) on vLLM's own ``CPUOffloadingSpec``, whose worker copies KV between
the GPU and the host with CUDA: the GPU twins of ``LookupEvictsSpec`` and ``LoadEvictsSpec``, for
tests/gpu/gpu_check.py. Loaded by vLLM as kvobs's inner spec (``inner_spec_module_path: gpudefects``, with
tests/gpu on the engine's PYTHONPATH); armed by the file named in ``KVOBS_DEFECT_TRIGGER``. Never in production."""

from __future__ import annotations

import os
from pathlib import Path

from vllm.v1.kv_offload.base import OffloadingManager
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from kvobs.demo.defects import TRIGGER_ENV, _arm_eviction_before_load, _arm_eviction_inside_lookup


class GpuLookupEvictsSpec(CPUOffloadingSpec):
    """Once armed, the lookup after a HIT evicts the chunk it reported (vLLM #50014's pattern): the load dies."""

    def get_manager(self) -> OffloadingManager:
        manager = super().get_manager()
        trigger = os.environ.get(TRIGGER_ENV)
        if trigger and not getattr(manager, "_kvobs_demo_defect", False):
            _arm_eviction_inside_lookup(manager, Path(trigger))
            manager._kvobs_demo_defect = True  # type: ignore[attr-defined]
        return manager


class GpuLoadEvictsSpec(CPUOffloadingSpec):
    """Once armed, the next load's first chunk is evicted just before the load (reaches hybrid models too)."""

    def get_manager(self) -> OffloadingManager:
        manager = super().get_manager()
        trigger = os.environ.get(TRIGGER_ENV)
        if trigger and not getattr(manager, "_kvobs_demo_defect", False):
            _arm_eviction_before_load(manager, Path(trigger))
            manager._kvobs_demo_defect = True  # type: ignore[attr-defined]
        return manager
