"""What a vLLM process loads of kvobs when it only asks the spec for its metrics and config keys.

Every vLLM process that has the plugin configured imports ``kvobs.vllm`` (vLLM's
``OffloadingSpecFactory`` imports ``spec_module_path`` and takes ``ObservedOffloadingSpec`` from it),
the API server included, which only calls ``build_metric_definitions`` and ``config_info_keys``.
None of kvobs's recording side belongs there: the observer, the history, the hot path (compiled or
not), the journal, the tracing sink and OpenTelemetry.

numpy is not asserted absent while vLLM itself loads it: measured, ``import
vllm.v1.kv_offload.base`` alone loads numpy and torch (2,489 modules on 0.33.0, 2,555 to 2,569 on
0.30.0-0.32.0; CPU torch), before kvobs runs a line. The probe measures that again and asserts
numpy absent too on a vLLM that does not.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvobs
from kvobs.hot_path_modules import HOT_PATH_MODULES
from tests.support.vllm_env import cpu_extra, observed_extra, tiering_extra

HEAVY = (
    "kvobs.history", "kvobs.observer", "kvobs.hot_path_loader", *(f"kvobs.{name}" for name in HOT_PATH_MODULES),
    "kvobs.hot_path__mypyc", "kvobs.journal", "kvobs.tracing",
)

PROBE = """
import json, sys
import vllm.v1.kv_offload.base
vllm_loads_numpy = "numpy" in sys.modules
import kvobs.vllm
from vllm.v1.kv_offload.base import OffloadingSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
for extra in json.loads(sys.argv[1]):
    spec_cls = OffloadingSpecFactory.get_spec_cls(extra)  # as vLLM loads the plugin
    assert spec_cls is kvobs.vllm.ObservedOffloadingSpec, spec_cls
    kvobs.vllm.ObservedOffloadingSpec.build_metric_definitions(extra)
    if hasattr(OffloadingSpec, "config_info_keys"):  # 0.33 only
        kvobs.vllm.ObservedOffloadingSpec.config_info_keys(extra)
modules = sorted(sys.modules)
# Then the lazy names: observe stays the function after its submodule of the same name is imported.
from kvobs.vllm.observe import observe
from kvobs.vllm.manager import ObservedOffloadingManager
lazy = kvobs.vllm.observe is observe and kvobs.vllm.ObservedOffloadingManager is ObservedOffloadingManager
print(json.dumps({"vllm_loads_numpy": vllm_loads_numpy, "modules": modules, "lazy": lazy}))
"""


@pytest.mark.slow
def test_the_api_servers_calls_load_none_of_kvobss_recording_side() -> None:
    configs = [
        observed_extra(inner, **options)
        for inner in (cpu_extra(2), tiering_extra(2))
        for options in ({}, {"vllm_metrics": True})
    ]
    out = subprocess.run(  # from the tree whose kvobs this test imported (``-c`` puts the cwd first)
        [sys.executable, "-c", PROBE, json.dumps(configs)], cwd=Path(kvobs.__file__).parents[1],
        capture_output=True, text=True, check=True, timeout=300,
    )
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    modules = set(probe["modules"])
    assert "kvobs.vllm.spec" in modules and "kvobs.vllm.vllm_metrics" in modules  # the probe ran the plugin
    heavy = sorted(m for m in modules if m in HEAVY or m.split(".")[0] == "opentelemetry")
    assert heavy == []
    if not probe["vllm_loads_numpy"]:
        assert "numpy" not in modules
    assert probe["lazy"]
