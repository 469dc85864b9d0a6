"""vLLM glue: the only kvobs package that imports vLLM (supported: vLLM 0.33.0)."""

from kvobs.vllm.manager import ObservedOffloadingManager
from kvobs.vllm.observe import observe
from kvobs.vllm.spec import ObservedOffloadingSpec

__all__ = ["ObservedOffloadingManager", "ObservedOffloadingSpec", "observe"]
