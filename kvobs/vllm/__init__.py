"""vLLM glue: the only kvobs package that imports vLLM (supported: vLLM 0.30.0 to 0.33.0)."""

from kvobs.vllm.logs import join_vllm_logging
from kvobs.vllm.manager import ObservedOffloadingManager
from kvobs.vllm.observe import observe
from kvobs.vllm.spec import ObservedOffloadingSpec

join_vllm_logging()  # every vLLM process that loads the plugin imports this package first

__all__ = ["ObservedOffloadingManager", "ObservedOffloadingSpec", "observe"]
