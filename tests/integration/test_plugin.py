"""The plugin as vLLM loads it: OffloadingSpecFactory.create_spec from a config dict."""

from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

from kvobs.options import OptionError
from kvobs.vllm import ObservedOffloadingManager, ObservedOffloadingSpec
from tests.support.vllm_env import cpu_extra, create_spec, key, observed_extra, tiering_extra

END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


@pytest.mark.parametrize(
    ("inner", "manager_cls"),
    [(cpu_extra(2), CPUOffloadingManager), (tiering_extra(2), TieringOffloadingManager)],
    ids=["cpu", "tiering"],
)
def test_plugin_wraps_the_inner_spec_and_explains_a_failure(inner: dict[str, Any], manager_cls: type) -> None:
    extra = observed_extra(inner, history_size=4096, engine="dp7")
    spec = create_spec(extra)
    assert isinstance(spec, ObservedOffloadingSpec)
    bare_spec = create_spec(inner)
    # What the connector and the API server read from a spec comes from the inner spec.
    assert spec.replicated_layout == bare_spec.replicated_layout
    assert spec.offload_prompt_only == bare_spec.offload_prompt_only
    assert spec.blocks_per_chunk == bare_spec.blocks_per_chunk
    assert spec.num_chunks == bare_spec.num_chunks == 2  # type: ignore[attr-defined]
    spec_cls = OffloadingSpecFactory.get_spec_cls(extra)
    assert spec_cls.build_metric_definitions(extra) == type(bare_spec).build_metric_definitions(inner)
    if hasattr(type(bare_spec), "config_info_keys"):  # 0.33
        assert spec_cls.config_info_keys(extra) == type(bare_spec).config_info_keys(inner)

    manager = spec.get_manager()
    bare_spec.get_manager().shutdown()
    try:
        assert isinstance(manager, ObservedOffloadingManager) and isinstance(manager.inner, manager_cls)
        assert spec.get_manager() is manager
        assert manager.observer.options.history_size == 4096 and manager.observer.options.engine == "dp7"
        a, b = ReqContext("req-a"), ReqContext("req-b")
        for context in (a, b):
            manager.on_new_request(context)
        manager.prepare_store([key(1), key(2)], a)
        manager.complete_store([key(1), key(2)], a)
        manager.on_schedule_end(END)
        assert manager.lookup(key(1), a) is LookupResult.HIT
        manager.prepare_store([key(3), key(4)], b)
        with pytest.raises(AssertionError, match=r"not found in cache \(group=0, req_id='req-a'\).*"
                           r"cause: evicted_after_lookup .*path=store, req_id='req-b'"):
            manager.prepare_load([key(1)], a)
        stats = manager.get_stats()
        assert stats is not None
        declared = spec_cls.build_metric_definitions(extra)
        assert set(stats.data["data"]) <= set(declared)  # the API server's stat logger asserts this
    finally:
        manager.shutdown()


@pytest.mark.parametrize("dp_index", [0, 3])
def test_default_engine_label_is_the_dp_rank(dp_index: int) -> None:
    spec = create_spec(observed_extra(cpu_extra(2)), dp_index=dp_index)
    manager = spec.get_manager()
    try:
        assert isinstance(manager, ObservedOffloadingManager)
        # vLLM's own labels (vllm/v1/metrics/loggers.py): the DP index as a number, the served model
        # (here the model path: the config built outside a connector names no served model).
        assert manager.observer.options.engine == str(dp_index)  # rank 3 too: not a fixed "0"
        assert manager.observer.options.model_name == "kvobs-test"
    finally:
        manager.shutdown()


@pytest.mark.parametrize(
    ("kvobs_config", "pattern"),
    [
        ({"inner_spec": "CPUOffloadingSpec", "histroy_size": 5}, "unknown kvobs option 'histroy_size'"),
        ({"history_size": "1M"}, "'history_size' must be an integer"),
        ({"history_size": 10**12}, "'history_size' must be in"),
        ({"inner_spec": "NoSuchSpec"}, "'inner_spec': cannot load offloading spec 'NoSuchSpec'"),
        ({"inner_spec": "Nope", "inner_spec_module_path": "no.such.module"}, "from 'no.such.module'"),
        ({"inner_spec": 3}, "'inner_spec' must be a non-empty string"),
        ({"inner_spec": "ObservedOffloadingSpec"}, "cannot be ObservedOffloadingSpec"),
    ],
)
def test_bad_kvobs_config_fails_at_start_up_naming_the_option(kvobs_config: dict[str, Any], pattern: str) -> None:
    extra = {**cpu_extra(2), "spec_name": "ObservedOffloadingSpec", "spec_module_path": "kvobs.vllm",
             "kvobs": kvobs_config}
    with pytest.raises(OptionError, match=pattern):
        create_spec(extra)
    with pytest.raises(OptionError, match=pattern):  # the API server's path
        OffloadingSpecFactory.get_spec_cls(extra).build_metric_definitions(extra)


def test_kvobs_section_must_be_an_object() -> None:
    extra = {**cpu_extra(2), "spec_name": "ObservedOffloadingSpec", "spec_module_path": "kvobs.vllm", "kvobs": [1]}
    with pytest.raises(OptionError, match=r"kv_connector_extra_config\['kvobs'\] must be an object"):
        create_spec(extra)


def test_inner_spec_errors_are_vllms_own() -> None:
    extra = observed_extra({"spec_name": "CPUOffloadingSpec"})  # no cpu_bytes_to_use
    with pytest.raises(Exception, match="cpu_bytes_to_use must be specified"):
        create_spec(extra)
