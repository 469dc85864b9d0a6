"""The soak's injected defect on the production tier (``benchmarks/soak.py --defects``).

demo/defects.py's eviction just before a load (vLLM #50014's pattern, after the whole lookup
pass so that it reaches hybrid models), armed on vLLM's ``TieringOffloadingSpec`` with kvobs's copy
worker, the spec the soak runs, instead of the CPU-only spec the demo's defects wrap. Loaded by vLLM
as kvobs's inner spec (``benchmarks.soak_defect``); never configure it in production.
"""

from __future__ import annotations

from demo.cpu_worker import TieringCopyOffloadingSpec
from demo.defects import ArmedDefect, _arm_eviction_before_load


class TieringLoadEvictsSpec(ArmedDefect, TieringCopyOffloadingSpec):
    """The production tier whose manager, once armed, evicts the first chunk of the next load just before it."""

    arm = staticmethod(_arm_eviction_before_load)
