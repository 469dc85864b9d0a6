"""kvobs's demo defects (demo/defects.py) on vLLM's own ``CPUOffloadingSpec``, whose worker copies KV between
the GPU and the host with CUDA: the GPU twins of ``LookupEvictsSpec`` and ``LoadEvictsSpec``, for
tests/gpu/gpu_check.py. Loaded by vLLM as kvobs's inner spec (``inner_spec_module_path: gpudefects``, with
tests/gpu on the engine's PYTHONPATH); armed by the file named in ``KVOBS_DEFECT_TRIGGER``. Never in production."""

from __future__ import annotations

from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from demo.defects import ArmedDefect, _arm_eviction_before_load, _arm_eviction_inside_lookup


class GpuLookupEvictsSpec(ArmedDefect, CPUOffloadingSpec):
    """Once armed, the lookup after a HIT evicts the chunk it reported (vLLM #50014's pattern): the load dies."""

    arm = staticmethod(_arm_eviction_inside_lookup)


class GpuLoadEvictsSpec(ArmedDefect, CPUOffloadingSpec):
    """Once armed, the next load's first chunk is evicted just before the load (reaches hybrid models too)."""

    arm = staticmethod(_arm_eviction_before_load)
