"""kvobs's series join vLLM's own as they are: the same label names and values, no relabeling.

vLLM labels its series ``model_name`` (the served model) and ``engine`` (the engine index, "0", "1",
...; ``vllm/v1/metrics/loggers.py``). The plugin reads both from vLLM at start-up; here through
vLLM's real ``OffloadingConnector`` and kvobs's subclass of it (the model config is a stand-in: a
real ``ModelConfig`` needs a model's files, see ``kvobs/vllm/modelless_config.py``), and end to end
through a real Prometheus.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from kvobs.vllm import ObservedOffloadingManager, modelless_config
from tests.support.services import ROOT, Prometheus, Sidecar, free_port, http_get, wait_for

VLLM_METRICS = "tests.support.vllm_metrics_process"  # run as a module from the repository root
# prometheus_client 0.26 writes vLLM's ``vllm:`` sample names as ``vllm_`` in OpenMetrics (which
# Prometheus asks for first), its HELP/TYPE lines keeping the colon; the text format keeps it. So
# vLLM's series are selected by a name pattern taking either (README, "Joining vLLM's series").
STORE_BYTES = '{__name__=~"vllm[:_]kv_offload_store_bytes_total"}'
LOAD_BYTES = '{__name__=~"vllm[:_]kv_offload_load_bytes_total"}'
HARNESS_MODEL = "kvobs/cpu-harness"  # the model path kvobs/vllm/modelless_config.py's ModelFacts names


def connector_with(served_model_name: Any, dp_index: int = 0, *, kvobs_connector: bool = True,
                   **kvobs_options: Any) -> Any:
    """vLLM's real OffloadingConnector (scheduler side), or kvobs's subclass of it, with the kvobs
    plugin, as ``vllm serve`` builds it; the model config a stand-in carrying ``served_model_name``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    from kvobs.vllm.connector import ObservedOffloadingConnector

    extra = {"spec_name": "ObservedOffloadingSpec", "spec_module_path": "kvobs.vllm",
             "kvobs": {"inner_spec": "CPUOffloadingSpec", **kvobs_options}, "cpu_bytes_to_use": 1 << 20}
    vllm_config = modelless_config.make_vllm_config(extra)
    vllm_config.parallel_config.data_parallel_index = dp_index
    facts = modelless_config.ModelFacts()
    model_config = types.SimpleNamespace(**{f.name: getattr(facts, f.name) for f in dataclasses.fields(facts)},
                                         get_total_num_kv_heads=facts.get_total_num_kv_heads)
    if served_model_name is not None:
        model_config.served_model_name = served_model_name
    config = modelless_config.WithModelFacts(vllm_config)
    config.model_config = model_config  # type: ignore[assignment]
    connector_cls = ObservedOffloadingConnector if kvobs_connector else OffloadingConnector
    return connector_cls(config, KVConnectorRole.SCHEDULER, modelless_config.make_kv_cache_config(hybrid=False))


@pytest.mark.parametrize(
    ("served", "dp_index", "kvobs_connector", "options", "labels"),
    [
        ("qwen3-chat", 0, True, {}, ("qwen3-chat", "0")),  # --served-model-name qwen3-chat, kvobs's connector
        (["alias-a", "alias-b"], 1, True, {}, ("alias-a", "1")),  # several names: vLLM's metrics use the first
        (None, 2, True, {}, (HARNESS_MODEL, "2")),  # no served name: the model path, as vLLM's own default
        # vLLM's own connector: the spec sees only the model path (vLLM's served name by default) ...
        ("qwen3-chat", 3, False, {}, (HARNESS_MODEL, "3")),
        # ... and the options say otherwise where needed.
        ("qwen3-chat", 0, False, {"model_name": "qwen3-chat", "engine": "a"}, ("qwen3-chat", "a")),
    ],
)
def test_the_plugin_takes_vllms_labels_through_the_real_connector(
    served: Any, dp_index: int, kvobs_connector: bool, options: dict[str, str], labels: tuple[str, str]
) -> None:
    connector = connector_with(served, dp_index, kvobs_connector=kvobs_connector, **options)
    manager = connector.connector_scheduler.manager
    try:
        assert isinstance(manager, ObservedOffloadingManager)
        assert (manager.observer.options.model_name, manager.observer.options.engine) == labels
    finally:
        manager.shutdown()
    from kvobs.vllm import compat

    assert compat.SERVED_MODEL_NAME.get() is None  # the connector's name does not outlive its construction


@pytest.mark.tools
@pytest.mark.slow
def test_kvobs_series_join_vllms_own_in_prometheus_without_relabeling(tmp_path: Path) -> None:
    """The engine of vllm_metrics_process.py serves vLLM's own ``vllm:kv_offload_*`` series (vLLM's
    KVConnectorProm labels them model_name/engine as the API server does) and journals for a real
    sidecar; one Prometheus job scrapes both with no relabeling at all."""
    directory = tmp_path / "kvobs"
    sidecar = Sidecar(directory).start()
    vllm_port = free_port()
    engine = subprocess.Popen([sys.executable, "-m", VLLM_METRICS, str(vllm_port), str(directory)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    prometheus = Prometheus(tmp_path / "prometheus", [f"127.0.0.1:{sidecar.port}", f"127.0.0.1:{vllm_port}"])
    try:
        wait_for(lambda: http_get(f"http://127.0.0.1:{vllm_port}/metrics")[0] == 200, timeout=120,
                 what="vLLM's metrics")
        prometheus.start()
        joined = ('kvobs_evicted_chunks_total{reason="capacity"} > 0 '
                  f'and on (model_name, engine) {STORE_BYTES}')
        wait_for(lambda: prometheus.query(joined), timeout=90, what="kvobs series joined with vLLM's")
        series = {(r["metric"]["model_name"], r["metric"]["engine"]) for r in prometheus.query(joined)}
        assert series == {(HARNESS_MODEL, "0")}
        # Before: engine="dp0" and no model_name on kvobs's side; this ratio was empty without relabeling.
        ratio = prometheus.query(
            "sum by (model_name, engine) (kvobs_evicted_chunks_total) / on (model_name, engine) "
            f"sum by (model_name, engine) ({STORE_BYTES})")
        assert [(r["metric"], float(r["value"][1]) > 0) for r in ratio] == [
            ({"model_name": HARNESS_MODEL, "engine": "0"}, True)]
        info = prometheus.query("kvobs_build_info * on (model_name, engine) group_left "
                                f"sum by (model_name, engine) ({LOAD_BYTES})")
        assert {r["metric"]["engine"] for r in info} == {"0"}  # the sidecar is no engine
    finally:
        prometheus.stop()
        engine.terminate()
        engine.wait(timeout=15)
        sidecar.stop()
